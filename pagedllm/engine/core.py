"""EngineCore: the step loop. It knows nothing of text or HTTP, only token ids."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from pagedllm.request import Request, RequestStatus
from pagedllm.worker.runner_output import ModelRunnerOutput, SampleLogprobs

if TYPE_CHECKING:
    from pagedllm.core.kv_groups import KVGroups
    from pagedllm.executor import Executor
    from pagedllm.kv_transfer.mooncake import MooncakeScheduler
    from pagedllm.kv_transfer.offload import OffloadScheduler
    from pagedllm.structured_output import StructuredOutputManager
    from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm")


@dataclass(slots=True)
class EngineCoreOutput:
    """What happened to one request in one step."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[SampleLogprobs] = field(default_factory=list)
    prompt_logprobs: tuple[int, list[SampleLogprobs]] | None = None  # (first position, entries)
    pooling_output: list[float] | None = None  # a pooling request's vector, in the step it finished

    @property
    def finished(self) -> bool:
        return self.request.status.finished


@dataclass(slots=True)
class _Step:
    """A scheduled step on its way through the workers."""

    t0: float  # monotonic time it was scheduled
    sched_out: SchedulerOutput
    decode: int  # of its tokens, those of requests already decoding (the rest are prompt tokens)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        num_blocks: int,
        max_model_len: int,
        structured: StructuredOutputManager | None = None,
        kv_connector: OffloadScheduler | MooncakeScheduler | None = None,
        kv_groups: KVGroups | None = None,
        pooling_needs_kv: bool = True,
        encoder: tuple[int, int] | None = None,
        whole_images: bool = False,
    ):
        self.config = config
        self.structured = structured
        self._grammar_wait: list[Request] = []  # WAITING_FOR_GRAMMAR: outside the scheduler until compiled
        # the last steps, for snapshot() and traces: (monotonic start, seconds, decode tokens, prefill tokens)
        self.step_history: deque[tuple[float, float, int, int]] = deque(maxlen=600)
        self.last_scheduled: dict[str, int] = {}  # the last step's tokens per (child) request, for tracers
        self.executor = executor
        spec = config.speculative_config
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            num_blocks,
            max_model_len,
            num_lookahead_tokens=spec.num_lookahead_tokens if spec else 0,
            speculative=spec is not None,
            max_loras=config.lora_config.max_loras,
            kv_connector=kv_connector,
            kv_groups=kv_groups,
            pooling_needs_kv=pooling_needs_kv,
            encoder=encoder,
            whole_images=whole_images,
        )
        self._aborted: list[Request] = []  # finished outside a step (aborted, or failed alone): reported next
        # for tests: called as fault_hook(stage, sched_out) where a step runs its model ("execute": a fault there
        # is isolated to its request) and before its output is applied ("update": a fault the engine cannot
        # attribute)
        self.fault_hook: Callable[[str, SchedulerOutput], None] | None = None
        # pipeline parallelism: steps submitted and not yet completed, oldest first, at most one per stage
        self.max_in_flight = config.parallel_config.pipeline_parallel_size
        self._in_flight: deque[_Step] = deque()

    @property
    def runner(self) -> ModelRunner:
        """The model runner of a single-process engine (for tests and tools)."""
        from pagedllm.executor.uniproc import UniprocExecutor

        assert isinstance(self.executor, UniprocExecutor), "only a single-process engine holds its runner"
        return self.executor.runner

    def add_request(self, request: Request) -> None:
        if request.sampling_params.structured_outputs is not None:
            if self.structured is None:
                raise AssertionError("a constrained request reached an engine without structured outputs")
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.structured.submit(request)
            self._grammar_wait.append(request)
            return
        self.scheduler.add_request(request)

    def abort_requests(self, req_ids: list[str]) -> None:
        wanted = set(req_ids)
        for req in [
            r for r in self._grammar_wait if wanted & {r.request_id, *(c.request_id for c in r.pending_children)}
        ]:
            self._drop_waiting_for_grammar(req)
        self._aborted.extend(self.scheduler.abort_requests(req_ids))

    def _drop_waiting_for_grammar(self, req: Request, error: str | None = None) -> None:
        """Abort a request still waiting for its grammar; ``error`` (why) becomes its stop_reason."""
        assert self.structured is not None  # only constrained requests wait for a grammar
        self._grammar_wait.remove(req)
        for r in [req, *req.pending_children]:
            self.structured.remove(r.request_id)
            r.status = RequestStatus.FINISHED_ABORTED
            r.stop_reason = error
            self._aborted.append(r)

    def _admit_compiled(self) -> None:
        """Hand the requests whose grammar is ready to the scheduler (in arrival order); fail the others."""
        assert self.structured is not None  # only constrained requests wait for a grammar
        for req in list(self._grammar_wait):
            state = self.structured.poll(req)
            if state == "waiting":
                continue
            if state == "ready":
                self._grammar_wait.remove(req)
                req.status = RequestStatus.WAITING
                self.scheduler.add_request(req)
            else:
                logger.error("request %s aborted: %s", req.request_id, state)
                self._drop_waiting_for_grammar(req, state)

    def finish_request(self, req_id: str, stop_reason: str) -> None:
        """A stop string was found by the output processor: stop computing this request."""
        self.scheduler.finish_request(req_id, RequestStatus.FINISHED_STOPPED, stop_reason)
        self.scheduler.release(req_id)
        if self.structured is not None:
            self.structured.remove(req_id)

    def step(self) -> list[EngineCoreOutput]:
        """schedule -> execute -> update. Under pipeline parallelism up to ``pipeline_parallel_size`` steps
        are in flight (each stage busy with another): this submits a new step while there is room and
        something to compute, then completes the oldest one once the queue is full or nothing else fits."""
        if self.max_in_flight == 1:
            step = self._schedule()
            try:
                if self.fault_hook is not None:
                    self.fault_hook("execute", step.sched_out)
                runner_out = self.executor.execute_model(step.sched_out)
            except Exception as e:
                if not self._can_isolate(step):
                    raise
                return self._isolate(step, e)
            if self.fault_hook is not None:
                self.fault_hook("update", step.sched_out)
            return self._complete(step, runner_out)
        if len(self._in_flight) < self.max_in_flight:
            # one micro-batch per stage: each step takes its share of the requests, so the stages overlap
            s = self.scheduler
            share = -(-(len(s.running) + s.num_waiting_requests()) // self.max_in_flight)
            step = self._schedule(max(1, share))
            so = step.sched_out
            # an empty step still carries finished requests and block copies to the workers
            if so.total_num_scheduled_tokens or so.finished_req_ids or so.blocks_to_copy or so.kv_connector_meta:
                self.executor.submit(so)
                self._in_flight.append(step)
                if len(self._in_flight) < self.max_in_flight and so.total_num_scheduled_tokens:
                    return self._complete(None, None)  # room for one more: schedule it before waiting
        if not self._in_flight:
            return self._complete(None, None)
        return self._complete(self._in_flight.popleft(), self.executor.collect())

    def _can_isolate(self, step: _Step) -> bool:
        """A failed step's requests can be retried here when its one process holds all the step's state (other
        ranks of a parallel engine may be stuck mid-step) and the step had requests to blame."""
        from pagedllm.executor.uniproc import UniprocExecutor

        return isinstance(self.executor, UniprocExecutor) and bool(step.sched_out.num_scheduled_tokens)

    def _isolate(self, step: _Step, error: Exception) -> list[EngineCoreOutput]:
        ids = list(step.sched_out.num_scheduled_tokens)
        why = f"the engine failed computing this request: {type(error).__name__}: {error}"
        failed = self.scheduler.isolate_failure(step.sched_out, why)
        if failed:
            logger.error(
                "request %s failed in the engine step and was finished with an error",
                failed[0].request_id,
                exc_info=error,
            )
        else:
            logger.warning(
                "an engine step of %d requests failed (%s: %s); recomputing them one suspect at a time",
                len(ids),
                type(error).__name__,
                error,
            )
        self._aborted.extend(failed)
        return self._complete(None, None)

    def _schedule(self, max_seqs: int | None = None) -> _Step:
        t0 = time.monotonic()
        if self._grammar_wait:
            self._admit_compiled()
        sched_out = self.scheduler.schedule(max_seqs)
        if self.structured is not None and self.structured.matchers:
            sched_out.grammar_bitmask = self.structured.bitmasks(sched_out, self.scheduler.requests)
        if self._grammar_wait and sched_out.total_num_scheduled_tokens == 0 and not self._in_flight:
            assert self.structured is not None  # only constrained requests wait for a grammar
            self.structured.wait_any(0.005)  # only compiles pending: do not spin
        # decode tokens, counted now: by the time the step completes its requests may be gone
        reqs = self.scheduler.requests
        decode = sum(n for rid, n in sched_out.num_scheduled_tokens.items() if reqs[rid].output_token_ids)
        return _Step(t0, sched_out, decode)

    def _complete(self, step: _Step | None, runner_out: ModelRunnerOutput | None) -> list[EngineCoreOutput]:
        """Apply a finished step's output (None: no step finished now) and report what changed."""
        touched: list[tuple[Request, int]] = []
        plp: dict = {}
        pooled: dict = {}
        logprobs: dict[str, list[SampleLogprobs]] = {}
        if step is not None:
            assert runner_out is not None  # a finished step comes with its output
            sched_out = step.sched_out
            self.last_scheduled = sched_out.num_scheduled_tokens
            total = sched_out.total_num_scheduled_tokens
            if total:
                self.step_history.append((step.t0, time.monotonic() - step.t0, step.decode, total - step.decode))
            if runner_out.kv_load_failed:
                self.scheduler.handle_kv_load_failures(runner_out)
            if self.structured is not None and self.structured.matchers:
                self.structured.update(runner_out)
            touched = self.scheduler.update_from_output(sched_out, runner_out)
            if runner_out.kv_transfer_seconds is not None:
                assert self.scheduler.connector is not None  # only a connector's transfers are timed
                stats = self.scheduler.connector.stats
                stats.save_seconds += runner_out.kv_transfer_seconds[0]
                stats.load_seconds += runner_out.kv_transfer_seconds[1]
            plp = runner_out.prompt_logprobs
            pooled = runner_out.pooler_output
            logprobs = runner_out.logprobs
        outputs = [
            EngineCoreOutput(
                r,
                r.output_token_ids[-n:] if n else [],
                logprobs.get(r.request_id, [])[:n],
                plp.get(r.request_id),
                pooled.get(r.request_id),
            )
            for r, n in touched
        ]
        seen = {r.request_id for r, _ in touched}
        outputs += [
            EngineCoreOutput(self.scheduler.requests[rid], [], [], entries)  # a prefill chunk's share
            for rid, entries in plp.items()
            if rid not in seen and rid in self.scheduler.requests
        ]
        outputs += [EngineCoreOutput(r, []) for r in self._aborted]
        self._aborted = []
        for o in outputs:
            if o.finished:
                self.scheduler.release(o.request.request_id)
                if self.structured is not None:
                    self.structured.remove(o.request.request_id)
        return outputs

    def num_waiting_for_grammar(self) -> int:
        """Sequences held until their grammar compiles (n>1 siblings included)."""
        return sum(1 + len(r.pending_children) for r in self._grammar_wait)

    def is_waiting_for_grammar(self, req_id: str) -> bool:
        return any(r.request_id == req_id for r in self._grammar_wait)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._aborted)
            or bool(self._grammar_wait)
            or bool(self._in_flight)
        )

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def snapshot(self, max_requests: int = 256, check: bool = False) -> dict:
        """A plain picture of the engine now (engine thread only): the block map, the queues, the last steps.

        ``block_map`` has one character per KV block: ``.`` free, ``c`` free but holding a prefix-cached
        block (reusable until evicted), ``u`` used by one request, ``s`` shared (ref count > 1).
        ``check`` adds ``invariants``: "ok", or the first broken invariant of the block pool and scheduler
        (ref counts against holders, the free queue, the hash map, who holds blocks).
        """
        s = self.scheduler
        codes = []
        for b in s.kv.pool.blocks:
            codes.append("s" if b.ref_cnt > 1 else "u" if b.ref_cnt == 1 else "c" if b.block_hash is not None else ".")
        block_map = "".join(codes)

        def info(r: Request) -> dict:
            return {
                "id": r.request_id,
                "status": r.status.name.lower(),
                "prompt_tokens": r.num_prompt_tokens,
                "computed_tokens": r.num_computed_tokens,
                "output_tokens": r.num_output_tokens,
                "max_tokens": r.max_tokens,
                "preemptions": r.num_preemptions,
                "waited_s": round(time.monotonic() - r.arrival_time, 3),
            }

        waiting = sorted(
            (r for r in s.requests.values() if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)),
            key=lambda r: r.arrival_time,
        )
        sc = self.config.scheduler_config
        wall = time.time() - time.monotonic()
        extra = {}
        if check:
            try:
                s.check_invariants()
                extra["invariants"] = "ok"
            except AssertionError as e:
                extra["invariants"] = f"broken: {e}"
        return {
            **extra,
            "time": time.time(),
            "num_blocks": len(block_map),
            "block_size": s.kv.block_size,
            "blocks": {
                "free": block_map.count("."),
                "cached": block_map.count("c"),
                "used": block_map.count("u"),
                "shared": block_map.count("s"),
            },
            "block_map": block_map,
            "kv_cache_usage": s.kv.usage(),
            "num_running": len(s.running),
            "num_waiting": s.num_waiting_requests(),
            "num_waiting_for_grammar": self.num_waiting_for_grammar(),
            "running": [info(r) for r in s.running[:max_requests]],
            "waiting": [info(r) for r in waiting[:max_requests]],
            "num_preemptions": s.num_preemptions,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "max_num_seqs": sc.max_num_seqs,
            "steps": [
                {"time": t + wall, "seconds": round(dt, 6), "decode_tokens": d, "prefill_tokens": p}
                for t, dt, d, p in self.step_history
            ],
        }
