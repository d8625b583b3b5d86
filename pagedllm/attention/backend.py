"""Picks an attention backend by name; the interface lives in :mod:`pagedllm.attention.interface`."""

from __future__ import annotations

from pagedllm.attention.interface import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]


def get_attention_backend(name: str = "auto") -> AttentionBackend:
    """'torch': the plain-torch reference. 'cpu_paged': decodes through the C kernel that reads the
    paged cache in place. 'auto': cpu_paged where the kernels build (it runs the kernel on CPU float32
    queries over float32 / bfloat16 / fp8 caches and defers to the reference elsewhere), else torch."""
    from pagedllm.attention import torch_ref

    if name == "auto":
        from pagedllm import kernels

        name = "cpu_paged" if kernels.try_load() is not None else "torch"
    if name == "torch":
        return torch_ref.paged_attention
    if name == "cpu_paged":
        from pagedllm.attention import cpu_paged

        return cpu_paged.paged_attention
    raise ValueError(f"unknown attention backend {name!r}; available: auto, cpu_paged, torch")
