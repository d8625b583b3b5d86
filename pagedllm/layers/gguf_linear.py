"""A linear layer on a GGUF's quantized blocks as the file stores them (``pagedllm/kernels/gguf_blocks.c``).

The weight is the file's own bytes, ``raw`` [N, bytes a row] uint8 (a view of a read-only mmap is fine):
nothing is widened at load, and decode reads the 4.5 bits a weight of Q4_K (6.56 of Q6_K) instead of a wider
layout of ours. Types: Q4_K, Q6_K, Q8_0 and Q5_0 (``GGUF_TYPES``), and Q5_K, Q4_0, Q4_1, Q5_1, Q3_K, Q2_K, IQ4_NL
and IQ4_XS in panels only (below).

``activation_bits=8`` (the "gguf" mode, llama.cpp's arithmetic): each row of the input is rounded to int8 per block
of 256 (per 32 for the types of 32-weight blocks) and the products are summed in integers. ``None`` ("gguf-exact"):
float32 activations, the float32 function of the dequantized weights. Either way the layer computes the same
function at every batch size, up to float summation order. int8, where the CPU has AVX2 (and on AVX-512 VNNI): a
weight of whole panels (the types of 32-blocks: and of pairs of blocks a row) is repacked at load into panels of 16
rows (the same bytes permuted; the file's pages are let go), and one kernel multiplies every row count, a row's bits
the same whatever shares its call (and the same at both levels); on AVX-512 VNNI other weights stream their blocks a
weight row at a time up to a few rows, and more rows (a prefill chunk, a large decode batch) run a GEMM over panels
of 16 weight rows decoded to bytes (3.2x the float GEMM on a dequantized copy at 512 rows of the 1.5B's Q4_K MLP).
float32, and int8 on the file's layout without that GEMM: up to ``SMALL_BATCH`` rows the kernels stream the blocks;
more rows dequantize the weight into a buffer shared by every quantized layer and run the float32 GEMM (on the
rounded input in the int8 mode).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.ops import GGUF_BLOCKS, GGUF_PANEL_ONLY, GGUF_PANELS
from pagedllm.layers.linear import SMALL_BATCH, onednn_available, onednn_linear
from pagedllm.layers.linear import float_bias as _bias
from pagedllm.layers.linear import quantized_scratch as _scratch

# the ggml types the kernels read, by name
GGUF_TYPES = {
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": 8,
    "Q2_K": 10,
    "Q3_K": 11,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
    "IQ4_NL": 20,
    "IQ4_XS": 23,
}


class GGUFLinear(nn.Module):
    """y = x @ W.T + b with W [N, K] the GGUF blocks ``raw`` [N, bytes a row] of ggml type ``qtype`` (an id of
    ``GGUF_TYPES``); ``activation_bits`` 8 (int8 activations) or None (float32). ``lookup_only``: a table that is
    only looked up (:meth:`rows`; an embedding's own, beside an LM head of its own) stays as given, not repacked:
    on a file's mapping only the pages of the rows read become resident (Qwen2.5-1.5B Q4_K_M's 125 MiB Q4_K
    embedding, repacked, was 0.12 GiB of the process's RSS); such a layer has no :meth:`forward`."""

    raw: torch.Tensor  # a buffer (register_buffer), typed for mypy

    def __init__(
        self,
        raw: torch.Tensor,
        qtype: int,
        bias: torch.Tensor | None = None,
        activation_bits: int | None = 8,
        lookup_only: bool = False,
    ):
        super().__init__()
        from pagedllm import kernels

        if qtype not in GGUF_BLOCKS and qtype not in GGUF_PANEL_ONLY:
            raise ValueError(f"GGUFLinear reads the ggml types {GGUF_TYPES}, not {qtype}")
        if activation_bits not in (None, 8):
            raise ValueError(f"GGUFLinear's activations are int8 (8) or float32 (None), not {activation_bits}")
        self._kernels = kernels.load().gguf
        self.file_qtype, self.activation_bits, self.lookup_only = qtype, activation_bits, lookup_only
        if activation_bits and not lookup_only:  # repacked into panels where the CPU runs them (GGUFBlocks.pack)
            from pagedllm.model_loader.mappings import release_mapped_pages

            # a copy: the pages of the file it was read from need not stay in this process
            qtype, raw = self._kernels.pack(qtype, raw, copied=release_mapped_pages)
        if qtype in GGUF_PANEL_ONLY and not lookup_only:
            name = next(n for n, t in GGUF_TYPES.items() if t == qtype)
            raise ValueError(
                f"GGUFLinear reads ggml type {qtype} ({name}) only in panels, with int8 activations, where the CPU "
                f"has AVX2 and the weight whole panels of 16 rows; got {list(raw.shape)} at "
                f"activation_bits={activation_bits}"
            )
        self.qtype = qtype
        self.register_buffer("raw", raw if raw.is_contiguous() else raw.contiguous(), persistent=False)
        self.out_features, self.in_features = raw.shape[0], self._kernels.in_features(qtype, raw)
        self.bias = _bias(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lookup_only:
            raise RuntimeError(f"this GGUFLinear ({self.extra_repr()}) is a table only looked up: it has no forward")
        if x.dim() != 2 or x.dtype != torch.float32:
            return self.forward(x.reshape(-1, self.in_features).float()).view(*x.shape[:-1], -1).to(x.dtype)
        x = x.contiguous()
        k = self._kernels
        if x.shape[0] > SMALL_BATCH and not (self.activation_bits and (k.has_gemm or self.qtype in GGUF_PANELS)):
            if self.activation_bits:  # on the activations the integer kernels see: the same function
                x = k.round_activations(x, k.activation_block(self.qtype))
            w = k.dequantize(self.qtype, self.raw, _scratch(self.out_features * self.in_features))
            return (onednn_linear if onednn_available() else F.linear)(x, w, self.bias)
        y = (k.matmul_a8 if self.activation_bits else k.matmul_f32)(self.qtype, x, self.raw)
        return y if self.bias is None else y.add_(self.bias)

    @property
    def rows_alone(self) -> bool:
        """Is each row's output computed alone, by one kernel at every row count (a weight in panels, int8
        activations)? Then a call on part of a step's rows costs its share of the step, no pass more over the
        whole weight (other layouts past a few rows widen the weight at every call)."""
        return bool(self.activation_bits) and self.qtype in GGUF_PANELS and not self.lookup_only

    def forward_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """forward(x) written into ``out`` (float32 [rows of x, out_features], contiguous), bit for bit; where
        rows_alone and without a bias (GatedMLP's gate|up in a buffer it reuses)."""
        if not self.rows_alone or self.bias is not None:
            raise ValueError(
                f"forward_into needs a weight in panels, int8 activations and no bias: {self.extra_repr()}"
            )
        return self._kernels.matmul_a8(self.qtype, x.contiguous(), self.raw, out=out)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(W float32 [N, K], gguf's values bit for bit; the bias)."""
        return self._kernels.dequantize(self.qtype, self.raw), self.bias

    def extra_repr(self) -> str:
        name = next(n for n, t in GGUF_TYPES.items() if t == self.file_qtype)
        layout = " in panels of 16 rows" if self.qtype != self.file_qtype else ""
        act = "int8" if self.activation_bits else "float32"
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        if self.lookup_only:
            return f"{shape}, {name} blocks as stored, only looked up"
        return f"{shape}, {name} blocks{layout}, {act} activations"

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W, float32 [len(ids), K]: an embedding lookup in the same table (a tied head's)."""
        return self._kernels.dequantize(self.file_qtype, self._kernels.unpack_rows(self.qtype, self.raw, ids))


_WIDEN_ELEMS = 16 << 20  # weights widened at a time for the float32 GEMM (64 MiB of float32: an MLP's, a head's slice)


class HalfLinear(nn.Module):
    """y = x @ W.T + b with W [N, K] an F16 or BF16 GGUF matrix as the file stores it, ``weight`` float16 /
    bfloat16 (a view of the file's read-only mapping is fine): 2 bytes a weight, never a float32 copy of the model.
    Every product is float32's, on the weights widened exactly, so both GGUF modes compute the float32 function of
    the file's weights (there is no integer arithmetic to run on a float weight). Up to ``SMALL_BATCH`` rows of x,
    and at every row count with ``one_kernel`` (the "gguf" mode: a row's bits never depend on what shares its call),
    ``gguf_matmul_half`` reads the weights where they lie, each row of x alone; more rows ("gguf-exact") widen the
    weight, 16M weights at a time, into the buffer the quantized layers share and run the float32 GEMM. A bfloat16
    weight under ``one_kernel`` on AVX512_BF16 is repacked into panels of 16 rows instead (``bf16_dot``) for
    bfloat16 dot products, x rounded to bfloat16 as llama.cpp rounds it: 2.7x the float32 path's speed at 128 rows
    of the 1.5B's shapes, one kernel at every row count, not float32's function."""

    weight: torch.Tensor  # a buffer (register_buffer), typed for mypy
    activation_dtype = torch.float32  # what it multiplies in (an adapter around it too), whatever its weight's dtype

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, one_kernel: bool = False, packed: bool = False
    ):
        super().__init__()
        from pagedllm import kernels

        if weight.dtype not in (torch.float16, torch.bfloat16) or weight.dim() != 2:
            got = f"{weight.dtype} {list(weight.shape)}"
            raise ValueError(f"HalfLinear takes a float16 or bfloat16 [N, K] weight, got {got}")
        self._kernels = kernels.load().gguf
        self.one_kernel = one_kernel
        self.out_features, self.in_features = weight.shape
        # "gguf" on AVX512_BF16: a bfloat16 weight in panels for bfloat16 dot products (x rounded to bfloat16);
        # ``packed``: weight is such panels already (GGUFBlocks.pack_bf16, as the loader hands them over)
        bf16_one = one_kernel and weight.dtype == torch.bfloat16
        if packed and not (bf16_one and self._kernels.has_bf16_dot):
            raise ValueError("packed bfloat16 panels run only as one kernel, on a CPU with AVX512_BF16")
        panels = self._kernels.pack_bf16(weight) if bf16_one and not packed else None
        self.bf16_dot = packed or panels is not None
        if panels is not None:
            from pagedllm.model_loader.mappings import release_mapped_pages

            release_mapped_pages(weight)  # the copy holds them: the file's pages can go
        self.register_buffer("weight", weight.contiguous() if panels is None else panels, persistent=False)
        self.bias = _bias(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.dtype != torch.float32:
            return self.forward(x.reshape(-1, self.in_features).float()).view(*x.shape[:-1], -1).to(x.dtype)
        x = x.contiguous()
        if self.bf16_dot:
            y = self._kernels.matmul_bf16_dot(x, self.weight)
        elif self.one_kernel or x.shape[0] <= SMALL_BATCH:
            y = self._kernels.matmul_half(x, self.weight)
        else:
            gemm = onednn_linear if onednn_available() else F.linear
            n, k = self.weight.shape
            rows = max(1, min(n, _WIDEN_ELEMS // k))
            if rows == n:
                return gemm(x, self._widened(0, n), self.bias)
            y = x.new_empty(x.shape[0], n)
            for first in range(0, n, rows):
                y[:, first : first + rows] = gemm(x, self._widened(first, rows), None)
        return y if self.bias is None else y.add_(self.bias)

    def _widened(self, first: int, rows: int) -> torch.Tensor:
        """Rows [first, first + rows) of W as float32, in the buffer the quantized layers share."""
        part = self.weight[first : first + rows]
        with torch.inference_mode():  # the shared buffer may have been made under it (an engine step)
            return _scratch(rows * self.in_features)[: part.numel()].view(part.shape).copy_(part)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(W float32 [N, K], exactly the file's values; the bias)."""
        w = self._kernels.unpack_bf16(self.weight) if self.bf16_dot else self.weight
        return w.float(), self.bias

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W, float32 [len(ids), K]: an embedding lookup in the same table (a tied head's)."""
        if self.bf16_dot:
            return self._kernels.unpack_bf16(self.weight, ids).float()
        return self.weight.index_select(0, ids).float()

    def extra_repr(self) -> str:
        kind = "float16" if self.weight.dtype == torch.float16 else "bfloat16"
        how = "one kernel at every row count" if self.one_kernel else f"the float32 GEMM above {SMALL_BATCH} rows"
        how += ", bfloat16 dot products in panels of 16 rows" if self.bf16_dot else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind} as stored, {how}"


class StackedLinear(nn.Module):
    """A fused projection (q | k | v, gate | up) whose shards the file stores in different block types (a
    Q4_K_M file mixes Q4_K and Q6_K): each shard's kernel computes its rows of the output, the bias is the
    fused one."""

    def __init__(self, parts: list[GGUFLinear], bias: torch.Tensor | None):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = _bias(bias)

    @property
    def rows_alone(self) -> bool:
        """GGUFLinear's, of every shard."""
        return all(cast(GGUFLinear, p).rows_alone for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.dtype != torch.float32:
            return self.forward(x.reshape(-1, self.in_features).float()).view(*x.shape[:-1], -1).to(x.dtype)
        parts = cast(list[GGUFLinear], list(self.parts))
        k = parts[0]._kernels
        one_kernel = k.has_gemm or all(p.qtype in GGUF_PANELS for p in parts) or x.shape[0] <= SMALL_BATCH
        if all(p.activation_bits and p.bias is None for p in parts) and one_kernel:
            # where each part would run its kernel: all in one call, the input rounded once
            y = k.matmul_a8_parts([p.qtype for p in parts], x.contiguous(), [p.raw for p in parts])
        else:
            y = torch.cat([p(x) for p in parts], dim=-1)
        return y if self.bias is None else y.add_(self.bias)

    def forward_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """GGUFLinear.forward_into of the fused projection: every shard rows_alone, no bias."""
        parts = cast(list[GGUFLinear], list(self.parts))
        if not self.rows_alone or self.bias is not None or any(p.bias is not None for p in parts):
            raise ValueError("forward_into needs every shard in panels with int8 activations, and no bias")
        k = parts[0]._kernels
        return k.matmul_a8_parts([p.qtype for p in parts], x.contiguous(), [p.raw for p in parts], out=out)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.cat([cast(GGUFLinear, p).dequantized()[0] for p in self.parts]), self.bias


def stacked_gguf(
    types: list[str],
    raws: tuple[torch.Tensor, ...],
    bias: torch.Tensor | None,
    activation_bits: int | None,
    lookup_only: bool = False,
) -> GGUFLinear | StackedLinear:
    """The linear of one module's GGUF shards as stored (``types``: their ggml type names): a GGUFLinear, or
    a StackedLinear of one a shard (several shards of one type are still one kernel call each: no copy).
    ``lookup_only``: one table only looked up (GGUFLinear's)."""
    if lookup_only and len(types) != 1:
        raise ValueError(f"a table only looked up is one tensor, not {len(types)} shards")
    parts = [
        GGUFLinear(raw, GGUF_TYPES[t], None, activation_bits, lookup_only) for t, raw in zip(types, raws, strict=True)
    ]
    if len(parts) == 1:
        parts[0].bias = _bias(bias)
        return parts[0]
    return StackedLinear(parts, bias)
