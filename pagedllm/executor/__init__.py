"""Executors: how the engine core reaches its workers. The scheduler never knows how many there are.

* ``uniproc``: one Worker in the engine's own process (one device, no collectives).
* ``mp``: one worker process per rank on this node, started as ``python -m
  pagedllm.executor.worker_process`` and joined by torch.distributed.
* ``ray``: one Ray actor per rank, in a placement group (one bundle per rank), across the
  nodes of a Ray cluster.

Every step the executor sends the SchedulerOutput to every rank and returns the
driver rank's ModelRunnerOutput. The ranks that do not sample learn last step's
tokens with the next step's message. A worker that dies or fails makes
``execute_model`` raise :class:`~pagedllm.errors.EngineDeadError` at once, after
stopping every other worker: nothing waits on a collective that can no longer finish.
"""

from __future__ import annotations

from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import ModelRunnerOutput, SchedulerOutput


class Executor:
    """The interface: start the workers, size the cache, run steps, stop."""

    config: EngineConfig

    def load_model(self) -> tuple[int, dict[str, float]]:
        """Load the weights on every rank; the number of KV blocks every rank has room for, and rank 0's
        loading stages."""
        results = self.collective_rpc("load_model")
        return min(n for n, _ in results), results[0][1]

    def init_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.collective_rpc("init_cache", num_blocks, max_model_len)

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


def make_executor(config: EngineConfig, source: Any, hf_config: Any, stages: dict[str, float],
                  lora_cache: Any = None) -> Executor:
    pc = config.parallel_config
    backend = pc.distributed_executor_backend or ("uniproc" if pc.world_size == 1 else "mp")
    if backend == "uniproc":
        from pagedllm.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config, source, hf_config, stages, lora_cache)
    if backend == "mp":
        from pagedllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from pagedllm.executor.ray_executor import RayExecutor

    return RayExecutor(config)


def worker_threads(world_size: int) -> int:
    """torch threads for each of ``world_size`` workers on this node: the cores shared out, at least one."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // world_size)
