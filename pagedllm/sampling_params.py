"""Per-request sampling parameters, with vLLM's names and semantics.

Every value is validated in ``__post_init__``; a bad one raises
:class:`~pagedllm.errors.InvalidParameterError` naming the parameter, the value
and the allowed range. Options not listed here are not accepted at all (a
``TypeError`` names the unknown keyword), so nothing is silently ignored.
"""

from __future__ import annotations

import enum
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.errors import InvalidParameterError

logger = logging.getLogger("pagedllm")


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a running request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # nothing until the request finishes


# A user logits processor: called for its request's row before temperature and top-k/p,
# as fn(output_token_ids, logits) or fn(prompt_token_ids, output_token_ids, logits); it
# returns the new logits row (1-D tensor over the vocabulary).
LogitsProcessor = Callable[..., Any]

_SAMPLING_EPS = 1e-5
INT64_MAX = (1 << 63) - 1  # every integer reaches the engine's tensors as int64
MAX_N = 1 << 16  # completions per prompt: each is a sequence in the engine, built before any is computed
MIN_TEMPERATURE = 1e-2  # a positive temperature below this is raised to it (vLLM's rule): logits / t overflow
MAX_TEMPERATURE = 1e4  # above this float32 logits / t underflow and masked tokens' -inf / t become NaN
REPETITION_PENALTY_RANGE = (1e-2, 1e2)  # outside it a logit divided or multiplied by it overflows float32

MAX_CHOICES = 1024  # a choice list longer than this is refused before any grammar is built
MAX_GRAMMAR_CHARS = 1 << 17  # schema / regex / grammar text
MAX_SCHEMA_DEPTH = 64  # nesting of a JSON schema (every backend walks it recursively)
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrain the output (vLLM's names); exactly one of the fields is set.

    ``json``: a JSON schema (dict or JSON text); ``regex``: the output matches it whole; ``choice``:
    exactly one of these strings; ``grammar``: an EBNF grammar (xgrammar's GBNF dialect, rule
    ``root``); ``json_object``: any JSON object.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        import json as _json

        def bad(msg: str, key: str) -> InvalidParameterError:
            return InvalidParameterError(f"structured_outputs.{key}: {msg}", f"structured_outputs.{key}")

        given = [
            k for k in _KINDS if getattr(self, k) is not None and not (k == "json_object" and self.json_object is False)
        ]
        if len(given) != 1:
            raise InvalidParameterError(
                f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got "
                f"{given or 'none'}",
                "structured_outputs",
            )
        if self.json is not None:
            if isinstance(self.json, str):
                if len(self.json) > MAX_GRAMMAR_CHARS:
                    raise bad(f"longer than {MAX_GRAMMAR_CHARS} characters", "json")
                try:
                    self.json = _json.loads(self.json)
                except ValueError as e:
                    raise bad(f"not valid JSON: {e}", "json") from None
            if not isinstance(self.json, dict):
                raise bad(f"a JSON schema is an object, got {type(self.json).__name__}", "json")
            if _depth(self.json) > MAX_SCHEMA_DEPTH:
                raise bad(f"nested deeper than {MAX_SCHEMA_DEPTH} levels", "json")
            if len(_json.dumps(self.json)) > MAX_GRAMMAR_CHARS:
                raise bad(f"longer than {MAX_GRAMMAR_CHARS} characters", "json")
        for key in ("regex", "grammar"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad("must be a non-empty string", key)
            if value is not None and len(value) > MAX_GRAMMAR_CHARS:
                raise bad(f"longer than {MAX_GRAMMAR_CHARS} characters", key)
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                raise bad("must be a non-empty list of strings", "choice")
            if len(self.choice) > MAX_CHOICES:
                raise bad(f"at most {MAX_CHOICES} choices, got {len(self.choice)}", "choice")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise bad("every choice must be a non-empty string", "choice")
            if sum(len(c) for c in self.choice) > MAX_GRAMMAR_CHARS:
                raise bad(f"longer than {MAX_GRAMMAR_CHARS} characters in all", "choice")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise bad("must be true or false", "json_object")

    @property
    def kind(self) -> str:
        return "json_object" if self.json_object else next(k for k in _KINDS[:4] if getattr(self, k) is not None)

    def cache_key(self) -> str:
        import json as _json

        return _json.dumps([self.kind, getattr(self, self.kind)], sort_keys=True)


@dataclass
class SamplingParams:
    n: int = 1
    """Number of completions per prompt. They share the prompt's KV blocks; with a seed, completion i uses seed + i."""
    temperature: float = 1.0
    """0 means greedy; otherwise logits are divided by it before sampling."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p. In (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's. In [0, 1]."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated. In [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted once per earlier occurrence of a token in the output. In [-2, 2]."""
    repetition_penalty: float = 1.0
    """Tokens in the prompt or output: positive logits divided by it, negative multiplied. > 0."""
    logit_bias: dict[int, float] | None = None
    """Token id -> bias added to its logit (OpenAI's range, [-100, 100])."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be sampled."""
    bad_words: list[str] | None = None
    """Words never to generate: their last token is banned wherever the rest would complete them."""
    seed: int | None = None
    """Seed of this request's own random stream: same seed, same tokens, whatever else is batched with it."""
    stop: list[str] | str | None = None
    """Stop strings; the output ends before the first one (unless include_stop_str_in_output)."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (in addition to EOS)."""
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    """Keep generating past the EOS token."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the context length."""
    min_tokens: int = 0
    """EOS and stop_token_ids are masked until this many tokens were generated."""
    logprobs: int | None = None
    """Return this many top logprobs per generated token (plus the sampled token's)."""
    prompt_logprobs: int | None = None
    """Return this many top logprobs per prompt position (plus the prompt token's); the first is None.
    Requests asking for them skip the prefix cache: cached positions would have no logits."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    """With skip_special_tokens=False: put a space around each special token, as transformers' slow
    tokenizers (and vLLM) do; False joins them directly, as fast tokenizers' decode does."""
    detokenize: bool = True
    """Produce text; with False only token ids are returned (stop strings then need detokenize)."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last k prompt tokens (left truncation)."""
    output_kind: RequestOutputKind | str = RequestOutputKind.CUMULATIVE
    """cumulative (default), delta, or final_only; LLM.generate always returns final outputs."""
    logits_processors: list[LogitsProcessor] | None = None
    """Per-request callables applied to the request's logits row after penalties and bias."""
    structured_outputs: StructuredOutputsParams | dict | None = None
    """Constrain the output to a JSON schema, regex, choice list or grammar (see StructuredOutputsParams)."""
    extra_args: dict[str, Any] | None = None
    """What travels with the request to the engine's plugins, as vLLM has it; ``kv_transfer_params`` is read by
    the KV connector (disaggregated prefill / decode, see MooncakeConnector)."""

    # Filled in by the engine (bind_eos), as vLLM has them: the ids min_tokens masks (stop_token_ids and the
    # model's EOS, whatever ignore_eos says), the ids that end generation (EOS only without ignore_eos), and
    # bad_words as token ids.
    _all_stop_token_ids: frozenset[int] = field(default=frozenset(), repr=False, compare=False)
    _finish_token_ids: frozenset[int] = field(default=frozenset(), repr=False, compare=False)
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False, compare=False)
    _processor_arities: list[int | None] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - {"json", "regex", "choice", "grammar", "json_object"}
            if unknown:
                raise InvalidParameterError(f"structured_outputs: unknown keys {sorted(unknown)}", "structured_outputs")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidParameterError(
                "structured_outputs must be a StructuredOutputsParams or a dict", "structured_outputs"
            )
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise InvalidParameterError("extra_args must be a dict", "extra_args")
        self._all_stop_token_ids = self._finish_token_ids = frozenset(self.stop_token_ids)

    def _validate(self) -> None:
        _int_at_least("n", self.n, 1, MAX_N)
        _number("temperature", self.temperature)
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidParameterError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}", "temperature"
            )
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %g is below %g: using %g", self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        _number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameterError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _int_at_least("top_k", self.top_k, -1)
        _number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParameterError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _number(name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidParameterError(f"{name} must be in [-2, 2], got {value}", name)
        _number("repetition_penalty", self.repetition_penalty)
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise InvalidParameterError(
                f"repetition_penalty must be in [{low:g}, {high:g}], got {self.repetition_penalty}",
                "repetition_penalty",
            )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidParameterError("logit_bias must map token ids to numbers", "logit_bias")
            bias = {}
            for tid, value in self.logit_bias.items():
                try:  # JSON object keys arrive as strings
                    tid = int(tid)
                except (TypeError, ValueError):
                    raise InvalidParameterError(f"logit_bias key {tid!r} is not a token id", "logit_bias") from None
                _number("logit_bias", value)
                if not 0 <= tid <= INT64_MAX or not -100.0 <= value <= 100.0:
                    raise InvalidParameterError(
                        f"logit_bias[{tid}]={value}: ids must be >= 0 and biases in [-100, 100]", "logit_bias"
                    )
                bias[tid] = float(value)
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidParameterError("allowed_token_ids must not be empty", "allowed_token_ids")
            for tid in self.allowed_token_ids:
                _int_at_least("allowed_token_ids", tid, 0)
        for word in self.bad_words or []:
            if not isinstance(word, str) or not word:
                raise InvalidParameterError(f"bad_words must be non-empty strings, got {word!r}", "bad_words")
            check_text("bad_words", word)
        if self.truncate_prompt_tokens is not None:
            _int_at_least("truncate_prompt_tokens", self.truncate_prompt_tokens, 1)
        if isinstance(self.output_kind, str):
            try:
                self.output_kind = RequestOutputKind[self.output_kind.upper()]
            except KeyError:
                raise InvalidParameterError(
                    f"output_kind must be one of cumulative, delta, final_only; got {self.output_kind!r}", "output_kind"
                ) from None
        if not isinstance(self.output_kind, RequestOutputKind):
            raise InvalidParameterError(
                f"output_kind must be a RequestOutputKind, got {self.output_kind!r}", "output_kind"
            )
        self._processor_arities = [_arity(fn) if callable(fn) else None for fn in self.logits_processors or []]
        if any(a not in (2, 3) for a in self._processor_arities):
            raise InvalidParameterError(
                "logits_processors must be callables fn(output_ids, logits) or fn(prompt_ids, output_ids, logits)",
                "logits_processors",
            )
        if self.seed is not None:
            _int_at_least("seed", self.seed, -(1 << 63))  # (and at most INT64_MAX, as every integer)
        if self.max_tokens is not None:
            _int_at_least("max_tokens", self.max_tokens, 1)
        _int_at_least("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameterError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})", "min_tokens"
            )
        if self.logprobs is not None:
            _int_at_least("logprobs", self.logprobs, 0)
        if self.prompt_logprobs is not None:
            _int_at_least("prompt_logprobs", self.prompt_logprobs, 0)
        assert isinstance(self.stop, list) and self.stop_token_ids is not None  # normalised by __post_init__
        for tid in self.stop_token_ids:
            _int_at_least("stop_token_ids", tid, 0)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParameterError(f"stop strings must be non-empty strings, got {s!r}", "stop")
            check_text("stop", s)
        if self.stop and not self.detokenize:
            raise InvalidParameterError("stop strings need detokenize=True", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def bind_eos(self, eos_token_ids: frozenset[int]) -> None:
        """Called by the engine once the model's EOS ids are known. ``ignore_eos`` lets EOS be generated
        without ending the output, but min_tokens still forbids it (vLLM's rule: ``min_tokens=max_tokens=N,
        ignore_eos=True`` gives N tokens none of which is EOS)."""
        assert self.stop_token_ids is not None  # normalised by __post_init__
        stop = frozenset(self.stop_token_ids)
        self._all_stop_token_ids = stop | eos_token_ids
        self._finish_token_ids = stop if self.ignore_eos else stop | eos_token_ids


def _depth(obj: Any) -> int:
    """How deeply dicts and lists nest in ``obj`` (iteratively: the object may be deep)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, d)
            if d <= MAX_SCHEMA_DEPTH:  # no need to look further down
                stack.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def _arity(fn: Callable) -> int | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return sum(
        p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params
    )


def apply_logits_processors(params: SamplingParams, prompt_ids: list[int], output_ids: list[int], row: Any) -> Any:
    assert params.logits_processors is not None  # the sampler calls this only for requests that have some
    for fn, arity in zip(params.logits_processors, params._processor_arities):
        row = fn(prompt_ids, output_ids, row) if arity == 3 else fn(output_ids, row)
    return row


def _number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise InvalidParameterError(f"{name} must be a number, got {value!r}", name)


def _int_at_least(name: str, value: object, low: int, high: int = INT64_MAX) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidParameterError(f"{name} must be an integer in [{low}, {high}], got {value!r}", name)


def check_text(name: str, text: str) -> None:
    """Refuse a string that is not valid Unicode (a lone UTF-16 surrogate such as "\\ud800", which JSON can
    carry): no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidParameterError(
            f"{name} is not valid Unicode: {e.reason} at character {e.start} ({text[e.start]!r})", name
        ) from None
