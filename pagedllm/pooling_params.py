"""PoolingParams: what a pooling request (an embedding) asks for, in place of SamplingParams' sampling."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.errors import InvalidParameterError


@dataclass(slots=True)
class PoolingParams:
    """vLLM's ``PoolingParams``, kept to what the pooling runner does.

    ``truncate_prompt_tokens``: keep at most this many prompt tokens (the first ones, and the final
    special token); -1 means the model's max_model_len. ``normalize``: L2-normalise the pooled vector
    (None: as the model's sentence-transformers files say).
    """

    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1)):
            raise InvalidParameterError(
                f"truncate_prompt_tokens must be -1 or at least 1, got {k!r}", "truncate_prompt_tokens"
            )
