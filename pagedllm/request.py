"""The engine's record of one request: its tokens and how far the KV cache has caught up.

There are no prefill/decode phases. Each step the scheduler computes
``num_tokens - num_computed_tokens`` more tokens (capped by the budget); a
decode is simply the case where that difference is 1.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.lora import LoRARequest
    from pagedllm.multimodal import MultiModalFeature
    from pagedllm.pooling_params import PoolingParams


class RequestStatus(enum.Enum):
    WAITING_FOR_GRAMMAR = enum.auto()  # held by the engine core until its grammar is compiled
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # failed in the engine (e.g. no valid token to sample); stop_reason says why

    @property
    def finished(self) -> bool:
        return self.value >= RequestStatus.FINISHED_STOPPED.value


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: min(user max_tokens, max_model_len - prompt length)
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    # Hashes of the full blocks of all_token_ids, extended as tokens arrive (prefix caching).
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # n > 1: every child is a Request; the first (the leader) computes the prompt, and the
    # others wait here until it has, then fork off its KV blocks (see Scheduler._fork).
    parent_id: str | None = None
    index: int = 0
    pending_children: list[Request] = field(default_factory=list)
    # The user request this one arrived with (a batch of prompts shares one): the FCFS queue serves
    # groups in turn, so one large request cannot hold back a small one that arrived after it.
    group: str | None = None
    # speculative decoding: the drafts proposed after the last step, verified in the next one
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # drafts verified so far
    num_accepted_tokens: int = 0  # of which accepted
    lora_request: LoRARequest | None = None  # the adapter this request runs with (None: the base model)
    trace_headers: dict[str, str] | None = None  # the client's W3C trace context, parent of its OTLP span
    # a pooling request (an embedding): computed whole in one step, samples nothing, finishes in that step
    pooling_params: PoolingParams | None = None
    # the prompt's images (vision-language models), in prompt order: where their placeholders are, their hashes
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    # what the KV connector says of the finished request (a producer: where its prompt's blocks wait for the
    # decode engine), returned with its output as vLLM's kv_transfer_params
    kv_transfer_params: dict | None = None

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def queue_group(self) -> str:
        return self.group or self.parent_id or self.request_id

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
