"""CPU paged attention: decodes read K/V in place through a C kernel; prefill as the torch reference.

The reference backend gathers each decode request's blocks into a padded
tensor per layer and step (a copy of the whole batch's context) before SDPA.
On CPU that copy cost as much as the attention itself; the kernel in
``pagedllm/kernels/paged_attention.c`` walks the block tables instead. It reads
float32, bfloat16 and fp8 caches (widening rows as it goes); float16 caches,
and shapes past its buffers, use the reference path.
"""

from __future__ import annotations

import functools

import torch

from pagedllm import kernels
from pagedllm.attention import torch_ref
from pagedllm.attention.backend import AttentionMetadata


def kernel_applies(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    _, _, bs, kvh, d = kv_cache.shape
    return (q.device.type == "cpu" and q.dtype == torch.float32 and kv_cache.dtype in kernels.KV_DTYPES
            and kv_cache.is_contiguous() and q.stride(-1) == 1 and q.stride(-2) == d
            and q.shape[1] // kvh <= kernels.MAX_GROUP and bs <= kernels.MAX_BLOCK_SIZE
            and d <= kernels.MAX_HEAD_DIM)


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
            sliding_window: int | None) -> torch.Tensor:
    if not kernel_applies(q, kv_cache):
        return torch_ref._decode(q, kv_cache, meta, scale, sliding_window)
    nd = q.shape[0]
    key = ("cpu_paged_starts", sliding_window)
    starts = meta.scratch.get(key)
    if starts is None:
        lens = meta.seq_lens[:nd]
        starts = torch.zeros_like(lens) if sliding_window is None else (lens - sliding_window).clamp(min=0)
        meta.scratch[key] = starts
    return kernels.load().paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens[:nd].contiguous(),
                                                 starts, scale)


paged_attention = functools.partial(torch_ref.paged_attention, decode=_decode)
