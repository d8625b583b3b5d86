"""CPU paged attention: decodes and prefills read K/V in place through C kernels.

The reference backend gathers each decode request's blocks into a padded
tensor per layer and step (a copy of the whole batch's context) before SDPA.
On CPU that copy cost as much as the attention itself; the kernels in
``pagedllm/kernels/paged_attention.c`` walk the block tables instead: one query
per request for decodes, and flash-style tiles of a request's queries for a
prefill or a chunk of one (causal and window skips, online softmax, no mask
tensor). They read float32, bfloat16, fp8 and int8 caches (widening rows as they go);
float16 caches, and shapes past their buffers, use the reference path.
"""

from __future__ import annotations

import functools

import torch

from pagedllm import kernels
from pagedllm.attention import kv_int8, torch_ref
from pagedllm.attention.interface import AttentionMetadata


def kernel_applies(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    _, _, bs, kvh, _ = kv_cache.shape
    d = kv_int8.head_dim(kv_cache)
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and kv_cache.dtype in kernels.KV_DTYPES
        and kv_cache.is_contiguous()
        and q.stride(-1) == 1
        and q.stride(-2) == d
        and q.shape[1] // kvh <= kernels.MAX_GROUP
        and bs <= kernels.MAX_BLOCK_SIZE
        and d <= kernels.MAX_HEAD_DIM
        and (kv_cache.dtype != torch.int8 or d % 4 == 0)  # int8 keys are scored four values to a dword
    )


def _decode(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, sliding_window: int | None
) -> torch.Tensor:
    if not kernel_applies(q, kv_cache):
        return torch_ref._decode(q, kv_cache, meta, scale, sliding_window)
    nd = q.shape[0]
    key = ("cpu_paged_starts", sliding_window)
    starts = meta.scratch.get(key)
    if starts is None:
        lens = meta.seq_lens[:nd]
        starts = torch.zeros_like(lens) if sliding_window is None else (lens - sliding_window).clamp(min=0)
        meta.scratch[key] = starts
    return kernels.load().paged_decode_attention(
        q, kv_cache, meta.block_tables, meta.seq_lens[:nd].contiguous(), starts, scale
    )


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    block_row: torch.Tensor,
    ctx_len: int,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
) -> bool:
    """One request's prefill (chunk) through the kernel; False where the reference path must run it."""
    if not kernel_applies(q, kv_cache) or out.stride(-1) != 1 or out.stride(-2) != q.shape[-1]:
        return False
    if ctx_len == 0 and kv_cache.dtype == torch.float32:  # nothing cached before: its own K/V, the cache's values
        # (a narrower cache is read from the cache, rounded as every later chunk and decode will read it)
        if any(t.dtype != torch.float32 or t.stride(-1) != 1 or t.stride(-2) != t.shape[-1] for t in (k, v)):
            return False
        kernels.load().prefill_attention(q, k, v, scale, sliding_window, out)
    else:
        kernels.load().paged_prefill_attention(q, kv_cache, block_row, ctx_len, scale, sliding_window, out)
    return True


paged_attention = functools.partial(torch_ref.paged_attention, decode=_decode, prefill=_prefill)
