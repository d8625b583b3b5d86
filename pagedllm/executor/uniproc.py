"""The single-process executor: one Worker in the engine's own process."""

from __future__ import annotations

from collections import deque
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.executor.base import Executor
from pagedllm.worker.runner_output import ModelRunnerOutput
from pagedllm.worker.worker import Worker


class UniprocExecutor(Executor):
    def __init__(
        self, config: EngineConfig, source: Any, hf_config: Any, stages: dict[str, float], lora_cache: Any = None
    ):
        self.config = config
        self.worker = Worker(config, source=source, hf_config=hf_config, stages=stages, lora_cache=lora_cache)
        self._pending: deque[SchedulerOutput] = deque()

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
