"""Plain-torch paged attention: the reference implementation and the test oracle for faster ones."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention import kv_int8
from pagedllm.attention.interface import AttentionMetadata

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8: PyTorch's CPU index kernels do not take fp8, and moving bytes is all they do."""
    return x.view(torch.uint8) if x.dtype in _FP8 else x


def _select_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    return _bytes(kv_cache).index_select(1, block_ids).view(kv_cache.dtype)


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    raw = _bytes(kv_cache)
    raw.index_copy_(1, dst, raw.index_select(1, src))


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _, num_blocks, block_size, kvh, d = kv_cache.shape
    flat = _bytes(kv_cache).view(2, num_blocks * block_size, kvh, d)
    for half, x in zip(flat, (k, v)):
        rows = kv_int8.quantize(x) if kv_cache.dtype == torch.int8 else x.to(kv_cache.dtype)
        half.index_copy_(0, slot_mapping, _bytes(rows))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    decode=None,
    prefill=None,
) -> torch.Tensor:
    """``decode`` replaces the batched one-token-query path, ``prefill`` (where it returns True, having written
    the request's rows of ``out``) one request's many-query path (see :mod:`pagedllm.attention.cpu_paged`)."""
    # every new K/V is written before any is read: requests in this step may share blocks
    write_kv(k, v, kv_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = (decode or _decode)(q[:nd], kv_cache, meta, scale, sliding_window)
    qsl, seq_lens = meta.query_start_loc, meta.seq_lens_cpu
    for i in range(nd, len(seq_lens)):
        start, end = qsl[i], qsl[i + 1]
        q_len, seq_len = end - start, seq_lens[i]
        spans = meta.bidirectional.get(i) if meta.bidirectional else None  # Gemma 3's images: a mask of their own
        if (
            not spans
            and prefill is not None
            and prefill(
                q[start:end],
                k[start:end],
                v[start:end],
                kv_cache,
                meta.block_tables[i],
                seq_len - q_len,
                scale,
                sliding_window,
                out[start:end],
            )
        ):
            continue
        k_start = 0
        qi, sc = q[start:end], scale
        if kv_cache.dtype == torch.int8:  # the query rounded as the kernels round it, the keys as stored
            qi, sc = kv_int8.round_query(qi, scale), 1.0
        if q_len == seq_len and kv_cache.dtype != torch.int8:  # nothing cached before: use the fresh K/V directly
            ki, vi = k[start:end], v[start:end]
        else:
            if sliding_window is not None:  # from the block of the first key the chunk's first query sees
                k_start = max(0, seq_len - q_len - sliding_window + 1) // meta.block_size * meta.block_size
            ki, vi = _gather(kv_cache, meta.block_tables[i], seq_len, meta.block_size, k_start)
        out[start:end] = _prefill(
            qi,
            kv_int8.widen(ki, q.dtype),
            kv_int8.widen(vi, q.dtype),
            seq_len - q_len,
            sc,
            sliding_window,
            k_start,
            spans,
        )
    return out


def _gather(kv_cache: torch.Tensor, block_row: torch.Tensor, seq_len: int, block_size: int, k_start: int = 0):
    """K and V at positions k_start (a multiple of block_size) .. seq_len - 1."""
    nb = -(-seq_len // block_size)
    # index_select, not kv_cache[:, idx]: advanced indexing costs time proportional to the whole cache
    blocks = _select_blocks(kv_cache, block_row[k_start // block_size : nb])  # [2, nb, bs, kvh, d]
    kv = blocks.flatten(1, 2)[:, : seq_len - k_start]
    return kv[0], kv[1]


def _prefill(
    q,
    k,
    v,
    ctx_len: int,
    scale: float,
    sliding_window: int | None,
    k_start: int = 0,
    spans: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """q: [Q, H, D] at positions ctx_len.. ; k, v: [S, KVH, D] at positions k_start..k_start + S - 1. ``spans``:
    [start, end) positions whose tokens also see each other's later ones (transformers' ``blockwise_overlay``:
    causal or in one span, then inside the window)."""
    q_len, seq_len = q.shape[0], k.shape[0]
    # with a batch dimension: 3-D inputs take a CPU path about 3x slower (8.2 vs 2.8 ms at 300 tokens)
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if ctx_len == 0 and sliding_window is None and not spans:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(ctx_len, ctx_len + q_len, device=q.device)[:, None]
        k_pos = torch.arange(k_start, k_start + seq_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        for a, b in spans or ():
            mask |= (q_pos >= a) & (q_pos < b) & (k_pos >= a) & (k_pos < b)
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _decode_plan(meta: AttentionMetadata, sliding_window: int | None, device: torch.device):
    """(flat block ids, context length L, mask [nd, 1, 1, L] or None), once per step and window."""
    key = ("decode", sliding_window)
    plan = meta.scratch.get(key)
    if plan is None:
        nd = meta.num_decodes
        lens = meta.seq_lens_cpu[:nd]
        max_len = max(lens)
        nb = -(-max_len // meta.block_size)
        block_ids = meta.block_tables[:nd, :nb].flatten()
        if sliding_window is None and min(lens) == max_len:
            plan = (block_ids, max_len, None)  # equal lengths: slice to the context, no mask
        else:
            seq_lens = meta.seq_lens[:nd, None]
            pos = torch.arange(nb * meta.block_size, device=device)[None, :]
            mask = pos < seq_lens
            if sliding_window is not None:
                mask &= pos >= seq_lens - sliding_window
            plan = (block_ids, nb * meta.block_size, mask[:, None, None, :])
        meta.scratch[key] = plan
    return plan


def _decode(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, sliding_window: int | None
) -> torch.Tensor:
    """One query token per request, batched: gather each request's blocks and mask past its length."""
    nd = q.shape[0]
    block_ids, length, mask = _decode_plan(meta, sliding_window, q.device)
    blocks = _select_blocks(kv_cache, block_ids)  # [2, nd * nb, bs, kvh, d]
    kv = blocks.view(2, nd, -1, *blocks.shape[-2:])[:, :, :length]  # [2, nd, L, kvh, d]
    k, v = (kv_int8.widen(x, q.dtype).transpose(1, 2) for x in kv)  # [nd, kvh, L, d]
    if kv_cache.dtype == torch.int8:  # the query rounded as the kernels round it
        q, scale = kv_int8.round_query(q, scale), 1.0
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)
