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

from pagedllm.executor.base import DistributedExecutor, Executor, worker_threads
from pagedllm.executor.factory import make_executor

__all__ = ["DistributedExecutor", "Executor", "make_executor", "worker_threads"]
