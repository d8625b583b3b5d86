"""Format-independent entry points: the config and weights of a ``ModelSource``."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Any

from pagedllm.model_loader.resolve import ModelSource

if TYPE_CHECKING:
    import torch

    from pagedllm.model_loader.hf_loader import LazyTensor


def load_config(src: ModelSource) -> Any:
    """The model's config: transformers' from config.json, or for a GGUF the same fields as plain
    attributes (:class:`~pagedllm.model_loader.gguf_loader.GGUFModelConfig`)."""
    from pagedllm.model_loader.cache import TRANSFORMERS_LOADS

    with TRANSFORMERS_LOADS:
        if src.kind == "gguf":
            from pagedllm.model_loader.gguf_loader import load_gguf_config

            return load_gguf_config(src.path)
        from pagedllm.model_loader.hf_loader import load_hf_config

        return load_hf_config(src.path)


def iter_weights(
    src: ModelSource, lazy: bool = False, skip: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """Yield ``(hf_parameter_name, float32 tensor)`` one tensor at a time.

    Names follow Hugging Face (``model.layers.0.self_attn.q_proj.weight``),
    linear weights are ``[out_features, in_features]``, and ``lm_head.weight``
    appears only when the checkpoint stores it (untied head). ``lazy``: safetensors values are
    :class:`~pagedllm.model_loader.hf_loader.LazyTensor`, read only in the part a tensor-parallel rank narrows
    them to (GGUF tensors are dequantized one at a time).
    Names in ``skip`` are left out, unread where the format allows.
    """
    if src.kind == "gguf":
        from pagedllm.model_loader.gguf_loader import iter_gguf_weights

        return iter_gguf_weights(src.path, skip)
    from pagedllm.model_loader.hf_loader import iter_hf_weight_slices, iter_hf_weights

    weights = iter_hf_weight_slices(src.path) if lazy else iter_hf_weights(src.path)
    return ((name, t) for name, t in weights if name not in skip) if skip else weights
