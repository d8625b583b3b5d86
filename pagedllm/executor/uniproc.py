"""The single-process executor: one Worker in the engine's own process."""

from __future__ import annotations

import gc
from collections import deque
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.errors import EngineDeadError
from pagedllm.executor.base import Executor
from pagedllm.worker.runner_output import ModelRunnerOutput
from pagedllm.worker.worker import Worker


class UniprocExecutor(Executor):
    def __init__(
        self, config: EngineConfig, source: Any, hf_config: Any, stages: dict[str, float], lora_cache: Any = None
    ):
        self.config = config
        self._worker: Worker | None = Worker(
            config, source=source, hf_config=hf_config, stages=stages, lora_cache=lora_cache
        )
        self._pending: deque[SchedulerOutput] = deque()

    @property
    def worker(self) -> Worker:
        if self._worker is None:
            raise EngineDeadError("the engine was shut down")
        return self._worker

    def shutdown(self) -> None:
        """Let go of the worker and of its model, draft and runner (which holds the KV cache): they are freed
        now, also where something still holds this executor or the worker itself (the traceback of a start
        that failed holds its engine, and the worker where the error came from inside it); on CUDA the memory
        goes back to the device, where a second engine in the process would size its KV cache from what is
        free."""
        worker, self._worker = self._worker, None
        if worker is None:
            return
        worker.model = worker.draft = worker.runner = None
        if worker.device.type == "cuda":
            del worker
            gc.collect()  # the start pauses the collector: cycles among the modules are freed here, not later
            torch.cuda.empty_cache()

    @property
    def runner(self) -> Any:
        return self.worker.runner

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = self.worker.execute_model(so)
        assert out is not None  # the one rank is the driver
        return out

    def submit(self, so: SchedulerOutput) -> None:
        self._pending.append(so)

    def collect(self) -> ModelRunnerOutput:
        return self.execute_model(self._pending.popleft())
