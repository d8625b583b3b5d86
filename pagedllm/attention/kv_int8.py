"""The int8 KV cache: each token's K (or V) row of one kv head as head_dim int8 values and its own scale.

A row of the cache is ``head_dim`` bytes of ``round(x * 127 / max|x|)`` followed by the 4 bytes of the float32
scale ``max|x| / 127`` (a row of zeros: scale 0), so a layer's cache is an int8 tensor
``[2, num_blocks, block_size, kv_heads, head_dim + 4]`` and a block stays one run of bytes: swapping, the prefix
cache's RAM and disk tiers and KV transfer move it as they move any other dtype's. A value reads back as
``q * scale``, float32. The C kernels (``paged_attention.c``, ``decode_loop.c``'s writes) use the same formula,
so whichever path writes a row, its bytes are the same.

The scale is per token and head, finer than a block's: appending a token never rescales the rows before it.

Attention over an int8 cache rounds each query row the same way (after the softmax scale) and scores in integers:
the C kernels' exact int8 dot products times both scales, the reference path the same values in float32
(:func:`round_query`). The weighted sum of V is float32 over the values as read.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
"""The float32 scale after each row's values."""


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The cache's last dimension for rows of ``head_dim`` values stored as ``dtype``."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def head_dim(kv_cache: torch.Tensor) -> int:
    """The head dimension a cache [..., row] holds."""
    return kv_cache.shape[-1] - (SCALE_BYTES if kv_cache.dtype == torch.int8 else 0)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows x [..., D] (any float dtype) as the cache's int8 rows [..., D + 4]."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    # 127 / amax rounded once, as the C writer's 127.f / amax (a Python number over a tensor would be 127 * (1 / amax))
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(x * inv).clamp_(-127, 127).to(torch.int8)
    scale = (amax / 127.0).contiguous()
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The cache's int8 rows [..., D + 4] as values [..., D] (``q * scale``, float32, then ``dtype``)."""
    q, raw = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:]
    scale = raw.contiguous().view(torch.float32)  # [..., 1]
    return (q.float() * scale).to(dtype)


def round_query(q: torch.Tensor, scale: float) -> torch.Tensor:
    """A query [..., D] times ``scale`` as attention over an int8 cache reads it: rounded as a cache row is (then
    attend with scale 1)."""
    return dequantize(quantize(q.float() * scale), q.dtype)


def widen(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache as ``dtype`` values: int8 rows dequantized, any other dtype converted."""
    if x.dtype == torch.int8:
        return dequantize(x, dtype)
    return x if x.dtype == dtype else x.to(dtype)
