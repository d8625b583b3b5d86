"""pagedllm: a small, fast LLM inference and serving engine (paged KV cache, continuous batching).

The top-level import stays light: heavy modules load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from pagedllm.logger import configure_logging as _configure_logging

_configure_logging()

_LAZY = {
    "LLM": "pagedllm.entrypoints.llm",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "SamplingParams": "pagedllm.sampling_params",
    "PoolingParams": "pagedllm.pooling_params",
    "RequestOutputKind": "pagedllm.sampling_params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "ModelRegistry": "pagedllm.models.registry",
    "EngineConfig": "pagedllm.config",
    "BeamSearchParams": "pagedllm.beam_search",
}

# Spelled out (not built from _LAZY) so linters and type checkers see the TYPE_CHECKING imports below as exports.
__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "ModelRegistry",
    "PoolingParams",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "__version__",
]
assert set(__all__) == {*_LAZY, "__version__"}

if TYPE_CHECKING:
    from pagedllm.beam_search import BeamSearchParams
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.models.registry import ModelRegistry
    from pagedllm.outputs import CompletionOutput, RequestOutput
    from pagedllm.pooling_params import PoolingParams
    from pagedllm.sampling_params import RequestOutputKind, SamplingParams


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
