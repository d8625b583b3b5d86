"""``speculative_config``: vLLM's JSON dict, checked into a typed record before anything loads."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pagedllm.errors import InvalidParameterError

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "medusa")
HEADS = ("eagle", "eagle3", "medusa")  # draft heads that read the target's hidden states
# a draft model's own weights: the quantized modes, and for a GGUF draft its file's blocks (gguf: int8 activations)
DRAFT_QUANTIZATIONS = ("int8", "int4", "w4a8", "w4a16", "gguf", "gguf-exact")


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # ngram: match the last n tokens (prompt_lookup_max down to prompt_lookup_min) in the request's context
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # draft_model: where the draft's weights are. Without one the target's own weights draft (then
    # `quantization` should make them cheaper, e.g. int4). eagle / eagle3 / medusa: the head's directory.
    model: str | None = None
    quantization: str | None = None
    # no drafts while more than this many requests run: a full batch is compute-bound, verification is not free
    disable_by_batch_size: int | None = None
    # back-off: a request whose drafts were all rejected this many times in a row pauses drafting
    # (1, 2, 4, ... steps, doubling while it keeps failing); 0 turns the back-off off
    backoff_after_rejections: int = 2
    # back-off by cost: drafting pauses while decode steps without it emit tokens faster (spec_decode/gate.py)
    backoff_by_cost: bool = True
    # each request's draft length follows its acceptance (transformers' "heuristic" schedule): it starts at
    # num_speculative_tokens, grows by 2 after a step whose drafts were all accepted and shrinks by 1 after one
    # with a rejection, within [1, num_speculative_tokens]; false drafts num_speculative_tokens every step
    adaptive_length: bool = False
    # draft_model: prompt lookup first. Where a request's context holds an earlier occurrence of its last
    # prompt_lookup_max tokens (the longest suffix only), what followed it is the request's draft this step and
    # the draft model does not run for it (its KV catches up when it next drafts); after a step whose lookup
    # draft lost its first token, the draft model drafts. Copy-heavy text (editing) then drafts for free.
    ngram_first: bool = False

    @staticmethod
    def from_dict(raw: Any) -> SpeculativeConfig:
        def bad(msg: str, key: str) -> InvalidParameterError:
            return InvalidParameterError(f"speculative_config.{key}: {msg}", f"speculative_config.{key}")

        if isinstance(raw, SpeculativeConfig):
            return raw
        if isinstance(raw, str):  # the CLI's JSON text, passed on as it is
            import json

            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise InvalidParameterError(f"speculative_config is not valid JSON: {e}", "speculative_config") from e
        if not isinstance(raw, dict):
            raise InvalidParameterError(
                f"speculative_config must be a JSON object, got {type(raw).__name__}", "speculative_config"
            )
        known = {f.name for f in fields(SpeculativeConfig)}
        for key in raw:
            if key not in known:
                raise bad(f"unknown key; valid keys: {', '.join(sorted(known))}", key)
        if "method" not in raw:
            raise bad(f"is required, one of {list(METHODS)}", "method")
        if raw["method"] not in METHODS:
            raise bad(f"unknown method {raw['method']!r}; available: {', '.join(METHODS)}", "method")
        if "num_speculative_tokens" not in raw:
            raise bad("is required (the number of draft tokens per step, >= 1)", "num_speculative_tokens")
        cfg = SpeculativeConfig(**raw)
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(cfg, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(f"must be an integer >= 1, got {value!r}", key)
        if cfg.num_speculative_tokens > 16:
            raise bad(f"must be <= 16, got {cfg.num_speculative_tokens}", "num_speculative_tokens")
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise bad(
                f"({cfg.prompt_lookup_min}) must be <= prompt_lookup_max ({cfg.prompt_lookup_max})", "prompt_lookup_min"
            )
        if cfg.disable_by_batch_size is not None and (
            not isinstance(cfg.disable_by_batch_size, int) or cfg.disable_by_batch_size < 1
        ):
            raise bad(f"must be an integer >= 1, got {cfg.disable_by_batch_size!r}", "disable_by_batch_size")
        if not isinstance(cfg.backoff_after_rejections, int) or cfg.backoff_after_rejections < 0:
            raise bad(f"must be an integer >= 0, got {cfg.backoff_after_rejections!r}", "backoff_after_rejections")
        for key in ("backoff_by_cost", "adaptive_length", "ngram_first"):
            if not isinstance(getattr(cfg, key), bool):
                raise bad(f"must be true or false, got {getattr(cfg, key)!r}", key)
        if cfg.method == "ngram" and (cfg.model or cfg.quantization):
            raise bad("does not apply to method 'ngram'", "model" if cfg.model else "quantization")
        if cfg.quantization not in (None, *DRAFT_QUANTIZATIONS):
            raise bad(f"must be one of {list(DRAFT_QUANTIZATIONS)}, got {cfg.quantization!r}", "quantization")
        for key in ("quantization", "ngram_first"):
            if getattr(cfg, key) and cfg.method != "draft_model":
                raise bad(f"only applies to method 'draft_model', not {cfg.method!r}", key)
        if cfg.method in HEADS and not (isinstance(cfg.model, str) and cfg.model):
            raise bad(f"method {cfg.method!r} needs the path of the head's directory", "model")
        return cfg

    @property
    def needs_draft_kv(self) -> bool:
        """Proposers that run attention keep their own paged KV cache under the target's block tables."""
        return self.method in ("draft_model", "eagle", "eagle3")

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots past the verified tokens the proposer writes its own KV into (its k-1 drafts and the new token)."""
        return self.num_speculative_tokens if self.needs_draft_kv else 0
