"""What a model runner returns each step; the scheduler's ``update`` reads it. Plain data and torch-free, so the
scheduler can import it without importing the runner."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ModelRunnerOutput:
    """The new tokens (and optional logprobs, one entry per token) of every request that reached the end of
    its known tokens: one sampled token, or with speculative decoding the accepted drafts and one more."""

    sampled: dict[str, list[int]]
    logprobs: dict[str, list[SampleLogprobs]] = field(default_factory=dict)
    # prompt logprobs computed this step: request id -> (first prompt position they predict, one per position)
    prompt_logprobs: dict[str, tuple[int, list[SampleLogprobs]]] = field(default_factory=dict)
    # the drafts proposed for each request's next step
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # KV connector: seconds the driver rank spent saving and loading blocks this step
    kv_transfer_seconds: tuple[float, float] | None = None
    # KV connector: blocks the driver rank could not load (a file gone or changed since it was checked)
    kv_load_failed: list[int] = field(default_factory=list)
    # pooling runner: each pooling request's pooled vector (float32 values), computed whole this step
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # requests that failed this step, each with why (no valid token to sample): the scheduler finishes them
    # with an error, and the step's other requests go on
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class SampleLogprobs:
    token_ids: list[int]  # the sampled token first, then the top-N
    logprobs: list[float]
    sampled_rank: int  # 1-based rank of the sampled token in the distribution
