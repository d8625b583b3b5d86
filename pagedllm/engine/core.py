"""EngineCore: the step loop. It knows nothing of text or HTTP, only token ids."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import SampleLogprobs, Scheduler, SchedulerStats
from pagedllm.request import Request, RequestStatus
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm")


@dataclass(slots=True)
class EngineCoreOutput:
    """What happened to one request in one step."""
    request: Request
    new_token_ids: list[int]
    new_logprobs: list[SampleLogprobs] = field(default_factory=list)
    prompt_logprobs: tuple[int, list[SampleLogprobs]] | None = None  # (first position, entries)

    @property
    def finished(self) -> bool:
        return self.request.status.finished


class EngineCore:
    def __init__(self, config: EngineConfig, runner: ModelRunner, num_blocks: int, max_model_len: int):
        self.config = config
        self.runner = runner
        spec = runner.spec_config
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, num_blocks, max_model_len,
                                   num_lookahead_tokens=spec.num_lookahead_tokens if spec else 0,
                                   speculative=spec is not None)
        self._aborted: list[Request] = []

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, req_ids: list[str]) -> None:
        self._aborted.extend(self.scheduler.abort_requests(req_ids))

    def finish_request(self, req_id: str, stop_reason: str) -> None:
        """A stop string was found by the output processor: stop computing this request."""
        self.scheduler.finish_request(req_id, RequestStatus.FINISHED_STOPPED, stop_reason)
        self.scheduler.release(req_id)

    def step(self) -> list[EngineCoreOutput]:
        sched_out = self.scheduler.schedule()
        runner_out = self.runner.execute_model(sched_out)
        touched = self.scheduler.update_from_output(sched_out, runner_out)
        plp = runner_out.prompt_logprobs
        outputs = [EngineCoreOutput(r, r.output_token_ids[-n:], runner_out.logprobs.get(r.request_id, [])[:n],
                                    plp.get(r.request_id))
                   for r, n in touched]
        seen = {r.request_id for r, _ in touched}
        outputs += [EngineCoreOutput(self.scheduler.requests[rid], [], [], entries)  # a prefill chunk's share
                    for rid, entries in plp.items() if rid not in seen and rid in self.scheduler.requests]
        outputs += [EngineCoreOutput(r, []) for r in self._aborted]
        self._aborted = []
        for o in outputs:
            if o.finished:
                self.scheduler.release(o.request.request_id)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._aborted)

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()
