"""Find a model on local disk and read its config, tokenizer and weights.

Importing this package is cheap: transformers, gguf, safetensors and torch are
imported only when a config, tokenizer or weights are actually loaded.
"""

from pagedllm.model_loader.loader import iter_weights, load_config
from pagedllm.model_loader.resolve import (
    DEFAULT_MODEL_NAME,
    ModelSource,
    default_model_path,
    resolve_model,
)
from pagedllm.model_loader.tokenizer import load_tokenizer

__all__ = [
    "DEFAULT_MODEL_NAME",
    "ModelSource",
    "default_model_path",
    "iter_weights",
    "load_config",
    "load_tokenizer",
    "resolve_model",
]
