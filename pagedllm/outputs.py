"""What users get back, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    time_in_queue: float | None
    # speculative decoding (None without it): drafts verified, and how many of them were accepted
    spec_num_draft_tokens: int | None = None
    spec_num_accepted_tokens: int | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # one entry per prompt token (None for the first), when SamplingParams.prompt_logprobs is set
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # from the KV connector, once finished (a prefill engine's: where the prompt's KV blocks wait), as vLLM's
    kv_transfer_params: dict | None = None
