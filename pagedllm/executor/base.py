"""The executor interface, and what the multi-process executors share."""

from __future__ import annotations

from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.worker.runner_output import ModelRunnerOutput


class Executor:
    """The interface: start the workers, size the cache, run steps, stop."""

    config: EngineConfig

    def load_model(self) -> tuple[int, dict[str, float]]:
        """Load the weights on every rank; the number of KV blocks every rank has room for, and rank 0's
        loading stages."""
        results = self.collective_rpc("load_model")
        return min(n for n, _ in results), results[0][1]

    def init_cache(
        self,
        num_blocks: int,
        max_model_len: int,
        num_offload_slots: int = 0,
        connector: tuple | None = None,
        kv_groups: Any = None,
    ) -> None:
        self.collective_rpc("init_cache", num_blocks, max_model_len, num_offload_slots, connector, kv_groups)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``Worker.method(*args)`` on every rank; their results in rank order."""
        raise NotImplementedError

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(so)
        return self.collect()

    def submit(self, so: SchedulerOutput) -> None:
        """Start a step without waiting for it (pipeline parallelism keeps one in flight per stage)."""
        raise NotImplementedError

    def collect(self) -> ModelRunnerOutput:
        """The output of the oldest step submitted and not yet collected."""
        raise NotImplementedError

    def failure(self) -> str | None:
        """Why this executor can run no more steps (a worker died or failed), else None. Cheap, and safe
        from any thread: /health asks it between steps."""
        return None

    def shutdown(self) -> None:
        pass


class DistributedExecutor(Executor):
    """What the ``mp`` and ``ray`` executors share: the step queue, the sampled tokens owed to the ranks
    that do not sample, and failing fast. A backend provides ``_call_all`` (every rank, results in rank
    order), ``_send_step`` / ``_receive_step`` (start a step; the driver's output of the oldest one) and
    ``_stop_workers``; each raises through :meth:`_fail` when a rank is lost."""

    def __init__(self, config: EngineConfig):
        from collections import deque

        from pagedllm.distributed import ParallelState

        self.config = config
        pc = config.parallel_config
        self.world_size = pc.world_size
        self.driver = ParallelState.driver_rank(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        self._dead: str | None = None
        self._started = False  # until the cache is allocated, a worker's ValueError is the user's bad argument
        self._unsent_sampled: dict[str, list[int]] = {}  # sampled tokens the non-driver ranks have not seen
        self._outstanding = 0  # steps submitted whose output has not been read
        self._early: deque[ModelRunnerOutput] = deque()  # outputs read ahead of collect() by collective_rpc

    def _call_all(self, method: str, args: tuple) -> list[Any]:
        raise NotImplementedError

    def _send_step(self, so: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """Start a step on every rank; the ranks other than the driver also get ``sampled``."""
        raise NotImplementedError

    def _receive_step(self) -> ModelRunnerOutput:
        raise NotImplementedError

    def _stop_workers(self) -> None:
        raise NotImplementedError

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        self._check_alive()
        while self._outstanding:  # steps still in flight answer first: keep their outputs for collect()
            self._early.append(self._collect_step())
        return self._call_all(method, args)

    def init_cache(
        self,
        num_blocks: int,
        max_model_len: int,
        num_offload_slots: int = 0,
        connector: tuple | None = None,
        kv_groups: Any = None,
    ) -> None:
        super().init_cache(num_blocks, max_model_len, num_offload_slots, connector, kv_groups)
        self._started = True

    def submit(self, so: SchedulerOutput) -> None:
        self._check_alive()
        self._send_step(so, self._unsent_sampled)
        self._unsent_sampled = {}
        self._outstanding += 1

    def collect(self) -> ModelRunnerOutput:
        return self._early.popleft() if self._early else self._collect_step()

    def _collect_step(self) -> ModelRunnerOutput:
        out = self._receive_step()  # the driver answers its steps in order
        self._outstanding -= 1
        for rid, tokens in out.sampled.items():  # the other ranks learn them with the next step
            self._unsent_sampled.setdefault(rid, []).extend(tokens)
        return out

    def failure(self) -> str | None:
        return self._dead

    def _check_alive(self) -> None:
        if self._dead is not None:
            from pagedllm.errors import EngineDeadError

            raise EngineDeadError(self._dead)

    def _fail(self, message: str, cause: BaseException | None = None) -> None:
        """A rank is lost: stop every worker (nothing may wait on a collective that cannot finish) and raise."""
        from pagedllm.errors import EngineDeadError

        self._dead = message
        self._stop_workers()
        if isinstance(cause, ValueError) and not self._started:
            raise cause  # a bad argument found while loading (e.g. an unsupported option): the user's error
        raise EngineDeadError(message) from cause


def worker_threads(world_size: int) -> int:
    """torch threads for each of ``world_size`` workers on this node: the cores shared out (within the CPU
    quota of a container), at least one."""
    from pagedllm.worker.cpu_share import usable_cores

    return max(1, usable_cores() // world_size)
