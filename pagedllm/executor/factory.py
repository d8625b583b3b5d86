"""Picks the executor a config asks for (``distributed_executor_backend``; uniproc for one rank, else mp)."""

from __future__ import annotations

from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.executor.base import Executor


def make_executor(
    config: EngineConfig, source: Any, hf_config: Any, stages: dict[str, float], lora_cache: Any = None
) -> Executor:
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
