"""Per-request sampling parameters, with vLLM's names and semantics.

Every value is validated in ``__post_init__``; a bad one raises
:class:`~pagedllm.errors.InvalidParameterError` naming the parameter, the value
and the allowed range. Options not listed here are not accepted at all (a
``TypeError`` names the unknown keyword), so nothing is silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.errors import InvalidParameterError

_SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    """Number of completions per prompt (only 1 is supported for now)."""
    temperature: float = 1.0
    """0 means greedy; otherwise logits are divided by it before sampling."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p. In (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's. In [0, 1]."""
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
    skip_special_tokens: bool = True
    detokenize: bool = True
    """Produce text; with False only token ids are returned (stop strings then need detokenize)."""

    # Filled in by the engine: the EOS id of the model and the stop set derived from it.
    _all_stop_token_ids: frozenset[int] = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()
        if self.top_k == -1:
            self.top_k = 0
        self._all_stop_token_ids = frozenset(self.stop_token_ids)

    def _validate(self) -> None:
        _int_at_least("n", self.n, 1)
        if self.n > 1:
            raise InvalidParameterError(f"n={self.n} is not supported yet; use n=1", "n")
        _number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidParameterError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        _number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameterError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _int_at_least("top_k", self.top_k, -1)
        _number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParameterError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.seed is not None:
            _int_at_least("seed", self.seed, -(1 << 63))
        if self.max_tokens is not None:
            _int_at_least("max_tokens", self.max_tokens, 1)
        _int_at_least("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameterError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})", "min_tokens")
        if self.logprobs is not None:
            _int_at_least("logprobs", self.logprobs, 0)
        for tid in self.stop_token_ids:
            _int_at_least("stop_token_ids", tid, 0)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParameterError(f"stop strings must be non-empty strings, got {s!r}", "stop")
        if self.stop and not self.detokenize:
            raise InvalidParameterError("stop strings need detokenize=True", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def bind_eos(self, eos_token_ids: frozenset[int]) -> None:
        """Called by the engine once the model's EOS ids are known."""
        extra = frozenset() if self.ignore_eos else eos_token_ids
        self._all_stop_token_ids = frozenset(self.stop_token_ids) | extra


def _number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise InvalidParameterError(f"{name} must be a number, got {value!r}", name)


def _int_at_least(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidParameterError(f"{name} must be an integer >= {low}, got {value!r}", name)
