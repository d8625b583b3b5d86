"""The loaded kernels as Python methods: ctypes signatures, and the tensors' shapes, strides and pointers.

:mod:`pagedllm.kernels.build` compiles and loads the library and wraps it in :class:`Kernels`.
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np

# limits of paged_attention.c's stack buffers, and the cache dtypes it reads (its kv_dtype codes)
MAX_GROUP, MAX_BLOCK_SIZE, MAX_HEAD_DIM = 32, 64, 256  # MAX_TASK_HEADS, MAX_BS, MAX_D
KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 2, torch.int8: 3}
"""The cache dtypes paged_attention.c reads, by its code (int8: rows with their scales, attention.kv_int8)."""


@functools.cache
def _fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """The float32 value of each of the 256 bytes of an fp8 format."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float().contiguous()


class Kernels:
    def __init__(self, lib: ctypes.CDLL, level: str = "native"):
        self.level = level
        """The instruction-set level the library was built for (:mod:`pagedllm.kernels.isa`)."""
        self.path: str = lib._name
        """The shared library's file (in the kernel cache)."""
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._matmul = lib.int4_matmul
        self._dequant = lib.int4_dequantize
        self._matmul8 = lib.int8_matmul
        self._dequant8 = lib.int8_dequantize
        self._matmul8_g16, self._dequant8_g16 = lib.int8_matmul_g16, lib.int8_dequantize_g16
        self._matmul_a8, self._matmul8_a8 = lib.int4_matmul_a8, lib.int8_matmul_a8
        self._quantize_q8 = lib.quantize_activations_q8
        self._quantize_q8.argtypes = [p, p, p, p, i64, i64, ctypes.c_int]
        lib.a8_gemm_available.argtypes, lib.a8_gemm_available.restype = [ctypes.c_int], ctypes.c_int
        self.a8_gemm_bits = frozenset(b for b in (4, 8) if lib.a8_gemm_available(b))
        """Weight widths whose *_matmul_a8 / _a16 take quant_matmul.c's integer GEMM above A8_GEMM_ROWS rows
        (any number of rows); the others must leave batches to the float32 GEMM (see _QuantLinear)."""
        self._attn = lib.paged_decode_attention
        self._prefill_attn = lib.paged_prefill_attention
        self._prefill_attn.argtypes = [
            p,
            i64,
            p,
            p,
            i64,
            i64,
            p,
            i64,
            i64,
            p,
            i64,
            i64,
            i64,
            i64,
            i64,
            ctypes.c_float,
            i64,
            ctypes.c_int,
            p,
        ]
        self._prefill_attn.restype = None
        self._norm, self._silu_mul, self._rotary = lib.add_rms_norm, lib.silu_mul, lib.rotary
        self._norm.argtypes = [p, p, p, p, i64, i64, ctypes.c_float]
        self._silu_mul.argtypes = [p, p, i64, i64]
        self._rotary.argtypes = [p, i64, p, p, p, i64, i64, i64]
        self._matmul.argtypes = [p, p, p, p, p, i64, i64, i64]
        self._dequant.argtypes = [p, p, p, p, i64, i64]
        self._matmul8.argtypes = [p, p, p, p, p, i64, i64, i64]
        self._matmul_a8.argtypes = self._matmul8_a8.argtypes = [p, p, p, p, p, i64, i64, i64, ctypes.c_int]
        self._dequant8.argtypes = self._dequant8_g16.argtypes = [p, p, p, p, i64, i64]
        self._matmul8_g16.argtypes = [p, p, p, p, p, i64, i64, i64]
        self._attn.argtypes = [p, i64, p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int, p]
        self._f32_matmul = lib.f32_matmul
        self._f32_matmul.argtypes = [p, p, p, i64, i64, i64]
        self._f32_matmul.restype = None
        self._decode_layers = lib.decode_layers
        self._decode_layers.argtypes = [
            p,
            i64,
            p,
            p,
            i64,
            i64,
            i64,
            i64,
            i64,
            i64,
            ctypes.c_float,
            p,
            p,
            p,
            p,
            p,
            i64,
            p,
            i64,
            ctypes.c_float,
        ]
        self._decode_layers.restype = ctypes.c_int
        self.gguf = GGUFBlocks(lib)
        """GGUF's quantized blocks run as stored (gguf_blocks.c)."""
        for fn in (
            self._matmul,
            self._dequant,
            self._matmul8,
            self._dequant8,
            self._attn,
            self._norm,
            self._silu_mul,
            self._rotary,
            self._matmul_a8,
            self._matmul8_a8,
            self._quantize_q8,
            self._matmul8_g16,
            self._dequant8_g16,
        ):
            fn.restype = None

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        starts: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q: [nd, H, D] float32 (rows may be strided, heads and dims contiguous); kv_cache: one layer's
        [2, num_blocks, bs, KVH, D] in a dtype of KV_DTYPES; block_tables [>= nd, M], seq_lens and
        starts [nd] int64."""
        nd, h, d = q.shape
        _, _, bs, kvh, _ = kv_cache.shape
        code = KV_DTYPES[kv_cache.dtype]
        lut = _fp8_table(kv_cache.dtype) if code == 2 else None
        out = q.new_empty(nd, h, d)
        self._attn(
            q.data_ptr(),
            q.stride(0),
            kv_cache[0].data_ptr(),
            kv_cache[1].data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            starts.data_ptr(),
            out.data_ptr(),
            nd,
            h,
            kvh,
            d,
            bs,
            scale,
            code,
            lut.data_ptr() if lut is not None else None,
        )
        return out

    def paged_prefill_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_row: torch.Tensor,
        ctx: int,
        scale: float,
        window: int | None,
        out: torch.Tensor,
    ) -> None:
        """One request's queries q [Q, H, D] float32 (rows may be strided, heads and dims contiguous) at positions
        ctx .. ctx + Q - 1, attending their own and earlier positions (within ``window``) of one layer's
        kv_cache [2, num_blocks, bs, KVH, D] through block_row [>= blocks] int64, into out [Q, H, D] (rows may
        be strided), in place."""
        _, _, bs, kvh, d = kv_cache.shape
        code = KV_DTYPES[kv_cache.dtype]
        lut = _fp8_table(kv_cache.dtype) if code == 2 else None
        self._prefill(q, kv_cache[0], kv_cache[1], kvh * d, kvh * d, block_row, ctx, bs, scale, window, out, code, lut)

    def prefill_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None, out: torch.Tensor
    ) -> None:
        """As paged_prefill_attention with nothing cached before the queries: their own K / V [Q, KVH, D]
        float32 (rows may be strided; heads and dims contiguous)."""
        self._prefill(q, k, v, k.stride(0), v.stride(0), _ZERO_ROW, 0, max(q.shape[0], 1), scale, window, out, 0, None)

    def _prefill(
        self,
        q,
        k,
        v,
        k_stride: int,
        v_stride: int,
        table: torch.Tensor,
        ctx: int,
        bs: int,
        scale: float,
        window: int | None,
        out: torch.Tensor,
        code: int,
        lut: torch.Tensor | None,
    ) -> None:
        n, h, d = q.shape
        self._prefill_attn(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            v.data_ptr(),
            k_stride,
            v_stride,
            table.data_ptr(),
            ctx,
            n,
            out.data_ptr(),
            out.stride(0),
            h,
            k.shape[-2],
            d,
            bs,
            scale,
            window or 0,
            code,
            lut.data_ptr() if lut is not None else None,
        )

    def decode_layers(
        self,
        layers,
        n_layers: int,
        x: torch.Tensor,
        out: torch.Tensor,
        t: int,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        inter: int,
        eps: float,
        final_norm: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        block_size: int,
        scale: float,
    ) -> int:
        """A decode step's layers (decode_loop.c; ``layers`` a ctypes array of its DecodeLayer). 0 or -1."""
        return self._decode_layers(
            ctypes.byref(layers),
            n_layers,
            x.data_ptr(),
            out.data_ptr(),
            t,
            hidden,
            heads,
            kv_heads,
            head_dim,
            inter,
            eps,
            final_norm.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            block_size,
            scale,
        )

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """x, residual: [T, n] float32 contiguous; x becomes x + residual in place; returns the norm."""
        out = torch.empty_like(x)
        self._norm(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            x.shape[1],
            eps,
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """gate_up: [T, 2 I] float32 contiguous; returns silu(gate) * up, [T, I] (written into ``out`` where given:
        float32 [T, I], contiguous)."""
        t, two_i = gate_up.shape
        out = _output(out, gate_up, t, two_i // 2)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2)
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] float32 with heads and dims contiguous (rows may be strided); cos, sin
        [T, 1, D/2] contiguous; returns the rotated heads, contiguous."""
        t, heads, d = x.shape
        out = x.new_empty(t, heads, d)
        self._rotary(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), t, heads, d)
        return out

    def int4_matmul(
        self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
    ) -> torch.Tensor:
        """x: [M, K] float32 contiguous; qweight [N, K/2] uint8, scales / mins [N, K/32]; returns [M, N]."""
        return self._quant_matmul(self._matmul, x, qweight, scales, mins)

    def int8_matmul(
        self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
    ) -> torch.Tensor:
        """x: [M, K] float32 contiguous; qweight [N, K] int8, scales / mins [N, K/32]; returns [M, N]."""
        return self._quant_matmul(self._matmul8, x, qweight, scales, mins)

    def int8_matmul_g16(
        self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
    ) -> torch.Tensor:
        """As int8_matmul with a scale per 16 weights (GGUF's Q6_K, Q3_K, Q2_K): scales [N, K/16], mins [N, K/16]
        (or [N, K/32]: each then taken for both halves of its group)."""
        return self._quant_matmul(self._matmul8_g16, x, qweight, scales, mins_per_16(mins, qweight.shape[1]))

    def f32_matmul(self, x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] float32 contiguous @ W^T with W [n, K] as ``f32_panels(W)``, for a decode step's few rows;
        each element summed in oneDNN's order (see quant_matmul.c)."""
        y = x.new_empty(x.shape[0], n)
        self._f32_matmul(x.data_ptr(), panels.data_ptr(), y.data_ptr(), x.shape[0], n, x.shape[1])
        return y

    @staticmethod
    def f32_panels(weight: torch.Tensor) -> torch.Tensor:
        """W [N, K] float32 as f32_matmul reads it: panels of 16 rows, [ceil(N / 16), K, 16], zero padded."""
        n, k = weight.shape
        padded = torch.nn.functional.pad(weight.detach().float(), (0, 0, 0, -n % 16))
        return padded.view(-1, 16, k).transpose(1, 2).contiguous()

    def int4_matmul_a8(
        self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
    ) -> torch.Tensor:
        """As int4_matmul, with each row of x first rounded to int8 per group of 32 (GGUF's Q8_0: scale
        max|x| / 127); the mins multiply the groups' exact float sums. Any number of rows."""
        return self._quant_matmul(self._matmul_a8, x, qweight, scales, mins, 1)

    def int8_matmul_a8(
        self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
    ) -> torch.Tensor:
        """As int8_matmul, with x rounded to int8 as in int4_matmul_a8."""
        return self._quant_matmul(self._matmul8_a8, x, qweight, scales, mins, 1)

    def int4_matmul_a16(
        self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
    ) -> torch.Tensor:
        """As int4_matmul_a8 with x rounded to int16 per group of 32 (scale max|x| / 32512), multiplied as
        two int8 digits."""
        return self._quant_matmul(self._matmul_a8, x, qweight, scales, mins, 2)

    def int8_matmul_a16(
        self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
    ) -> torch.Tensor:
        """As int8_matmul, with x rounded to int16 as in int4_matmul_a16."""
        return self._quant_matmul(self._matmul8_a8, x, qweight, scales, mins, 2)

    def quantize_activations(self, x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] float32 contiguous rounded as the *_a8 (bits 8) or *_a16 (bits 16) matmuls round it:
        (int8 [M, K * bits / 8]: per group of 32 its int8 values, or its high then its low base-255 digits;
        scales [M, K/32])."""
        digits = _digits(bits)
        q = torch.empty(x.shape[0], x.shape[1] * digits, dtype=torch.int8)
        d = x.new_empty(x.shape[0], x.shape[1] // 32)
        self._quantize_q8(x.data_ptr(), q.data_ptr(), d.data_ptr(), None, x.shape[0], x.shape[1], digits)
        return q, d

    def round_activations(self, x: torch.Tensor, bits: int = 8) -> torch.Tensor:
        """x [M, K] float32 contiguous as the *_a8 / *_a16 matmuls see it: each group of 32 rounded to
        ``bits``-bit integers and scaled back (float32 [M, K])."""
        out = torch.empty_like(x)
        self._quantize_q8(x.data_ptr(), None, None, out.data_ptr(), x.shape[0], x.shape[1], _digits(bits))
        return out

    @staticmethod
    def _quant_matmul(
        fn, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, *digits: int
    ) -> torch.Tensor:
        y = x.new_empty(x.shape[0], qweight.shape[0])
        fn(
            x.data_ptr(),
            qweight.data_ptr(),
            scales.data_ptr(),
            _ptr(mins),
            y.data_ptr(),
            x.shape[0],
            qweight.shape[0],
            x.shape[1],
            *digits,
        )
        return y

    def int4_dequantize(
        self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._quant_dequantize(self._dequant, qweight, scales, mins, qweight.shape[1] * 2, out)

    def int8_dequantize(
        self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._quant_dequantize(self._dequant8, qweight, scales, mins, qweight.shape[1], out)

    def int8_dequantize_g16(
        self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._quant_dequantize(
            self._dequant8_g16, qweight, scales, mins_per_16(mins, qweight.shape[1]), qweight.shape[1], out
        )

    @staticmethod
    def _quant_dequantize(
        fn, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, k: int, out: torch.Tensor | None
    ) -> torch.Tensor:
        """Into ``out`` (float32, at least N * K elements, contiguous) when given, else a new tensor."""
        n = qweight.shape[0]
        w = torch.empty(n, k, dtype=torch.float32) if out is None else out.view(-1)[: n * k].view(n, k)
        fn(qweight.data_ptr(), scales.data_ptr(), _ptr(mins), w.data_ptr(), n, k)
        return w


_Mins = TypeVar("_Mins", torch.Tensor, None)


def mins_per_16(mins: _Mins, k: int) -> _Mins:
    """The mins of an int8 layout with a scale per 16 as the kernels read them, one per 16 weights: mins given per
    32 (a block converted from a type with a min per 32, beside one with a scale per 16) repeated for both halves."""
    if mins is None or mins.shape[1] * 16 == k:
        return mins
    return mins.repeat_interleave(2, 1).contiguous()


# the types GGUFBlocks.to_groups converts to pagedllm's layouts: ggml id -> (layout, elements, bytes of a block)
GROUP_LAYOUTS = {
    2: ("int4", 32, 18),  # Q4_0
    3: ("int4", 32, 20),  # Q4_1
    6: ("int8", 32, 22),  # Q5_0
    7: ("int8", 32, 24),  # Q5_1
    8: ("int8", 32, 34),  # Q8_0
    12: ("int4", 256, 144),  # Q4_K
    13: ("int8", 256, 176),  # Q5_K
    14: ("int8", 256, 210),  # Q6_K
}
# the GGUF types gguf_blocks.c's matmul kernels read as stored (Q5_0, Q8_0, Q4_K, Q6_K): (elements, bytes) of a block
GGUF_BLOCKS = {t: GROUP_LAYOUTS[t][1:] for t in (6, 8, 12, 14)}
# the types read only in panels (GGUFBlocks.pack, where the CPU has them): Q4_0, Q4_1 and Q5_1 (Q4_0's and Q5_0's with
# a min a block), Q5_K, IQ4_NL (Q4_0's bytes, its nibbles indices of 16 int8 values), IQ4_XS (IQ4_NL's nibbles under
# a 6-bit scale per 32, a float16 per 256), Q3_K, Q2_K
GGUF_PANEL_ONLY = {
    2: GROUP_LAYOUTS[2][1:],
    3: GROUP_LAYOUTS[3][1:],
    7: GROUP_LAYOUTS[7][1:],
    13: GROUP_LAYOUTS[13][1:],
    20: (32, 18),
    23: (256, 136),
    11: (256, 110),
    10: (256, 84),
}
# Q2_K to Q6_K / Q8_0 / Q5_0 / Q4_0 / Q4_1 / Q5_1 / IQ4_NL / IQ4_XS repacked into panels of 16 rows (GGUFBlocks.pack):
# the same bytes a row, type id 100 + the file's
GGUF_PANELS = {100 + t: size for t, size in (GGUF_BLOCKS | GGUF_PANEL_ONLY).items()}
# (elements, bytes) of a block of every type gguf_blocks.c takes, as stored or in panels
_BLOCK_SIZES = GGUF_BLOCKS | GGUF_PANEL_ONLY | GGUF_PANELS
# the types whose panels hold their blocks (of 32) in pairs, so a row of a multiple of 64 weights: Q4_0, Q4_1, Q5_0,
# Q5_1, Q8_0, IQ4_NL
_PAIRED = (2, 3, 6, 7, 8, 20)


_PACK_ROWS = 4096  # rows GGUFBlocks.pack copies at a time (a multiple of 16)


def fits_panels(qtype: int, n: int, k: int) -> bool:
    """Whether a weight [n, k] of ggml type ``qtype`` can be repacked into panels (GGUFBlocks.pack, where the CPU
    has them): a type of GGUF_BLOCKS or GGUF_PANEL_ONLY, whole panels of 16 rows, and the types of 32-blocks
    (Q8_0 / Q5_0 / Q4_0 / Q4_1 / Q5_1 / IQ4_NL) rows of whole pairs of blocks."""
    return 100 + qtype in GGUF_PANELS and n > 0 and n % 16 == 0 and k % (64 if qtype in _PAIRED else 256) == 0


class GGUFBlocks:
    """gguf_blocks.c's kernels: a weight [N, K] is ``raw``, a uint8 tensor [N, bytes a row] holding the rows
    of a GGUF's blocks as the file stores them (e.g. a view of a read-only mmap), of a type in GGUF_BLOCKS."""

    def __init__(self, lib: ctypes.CDLL):
        p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._quantize = lib.gguf_quantize_q8
        self._quantize.argtypes, self._quantize.restype = [p, i64, i64, c_int, p, p, p, p], None
        self._matmul_a8, self._matmul_f32 = lib.gguf_matmul_a8, lib.gguf_matmul_f32
        self._matmul_a8.argtypes = self._matmul_f32.argtypes = [c_int, p, p, p, i64, i64, i64]
        self._matmul_q8 = lib.gguf_matmul_q8
        self._matmul_q8.argtypes = [c_int, p, p, p, p, p, i64, i64, i64]
        self._matmul_a8_parts = lib.gguf_matmul_a8_parts
        self._matmul_a8_parts.argtypes = [c_int, p, p, p, p, p, i64, i64]
        self._dequantize = lib.gguf_dequantize
        self._dequantize.argtypes = [c_int, p, p, i64, i64]
        self._to_groups = lib.gguf_to_groups
        self._to_groups.argtypes = [c_int, p, i64, i64, p, p, p]
        self._matmul_half = lib.gguf_matmul_half
        self._matmul_half.argtypes, self._matmul_half.restype = [c_int, p, p, p, i64, i64, i64], c_int
        self._pack_bf16, self._matmul_bf16_dot = lib.gguf_pack_bf16, lib.gguf_matmul_bf16_dot
        self._pack_bf16.argtypes, self._pack_bf16.restype = [p, p, i64, i64], c_int
        self._matmul_bf16_dot.argtypes, self._matmul_bf16_dot.restype = [p, p, p, i64, i64, i64], c_int
        lib.gguf_has_bf16_dot.restype = c_int
        self.has_bf16_dot = bool(lib.gguf_has_bf16_dot())
        """Whether bfloat16 weights run bfloat16 dot products (``pack_bf16``, ``matmul_bf16_dot``: AVX512_BF16)."""
        self._pack, self._unpack = lib.gguf_pack_panels, lib.gguf_unpack_rows
        self._pack.argtypes, self._unpack.argtypes = [c_int, p, p, i64, i64], [c_int, p, p, i64, i64, p]
        fns = (self._matmul_a8, self._matmul_f32, self._matmul_q8, self._matmul_a8_parts, self._dequantize)
        for fn in (*fns, self._to_groups, self._pack, self._unpack):
            fn.restype = c_int
        self._gemm_min_rows = ctypes.c_int.in_dll(lib, "gguf_gemm_min_rows")
        self._use_amx = ctypes.c_int.in_dll(lib, "gguf_use_amx") if hasattr(lib, "gguf_use_amx") else None
        lib.gguf_has_gemm.restype = lib.gguf_has_panels.restype = c_int
        self.has_gemm = bool(lib.gguf_has_gemm())
        """Whether many rows of integer activations on the file's layout run a GEMM (AVX-512 VNNI builds); else
        the row kernels, which a float GEMM on a dequantized copy beats from a few dozen rows."""
        self.has_panels = bool(lib.gguf_has_panels())
        """Whether ``pack`` repacks weights into panels of 16 rows, which one kernel multiplies at every row count
        (AVX2 and AVX-512 VNNI builds)."""

    @property
    def use_amx(self) -> bool:
        """Whether the panel GEMM's tiles of 16 rows of x take AMX (builds of the ``amx`` level only; the same
        bits either way): for tests and benchmarks to compare the two in one build."""
        return bool(self._use_amx.value) if self._use_amx is not None else False

    @use_amx.setter
    def use_amx(self, on: bool) -> None:
        if self._use_amx is not None:
            self._use_amx.value = int(on)

    @property
    def gemm_min_rows(self) -> int:
        """Integer activations of more rows than this run the panel GEMM (on AVX-512 VNNI), fewer the row
        kernels: the same integer products either way, summed in another float order."""
        return self._gemm_min_rows.value

    @gemm_min_rows.setter
    def gemm_min_rows(self, rows: int) -> None:
        self._gemm_min_rows.value = rows

    def pack(
        self, qtype: int, raw: torch.Tensor, copied: Callable[[torch.Tensor], object] | None = None
    ) -> tuple[int, torch.Tensor]:
        """``(qtype, raw)`` as the integer kernels read it best: a weight of a type in GGUF_BLOCKS with a multiple of 16
        rows (and, the types of 32-blocks, of 64 columns), where the panel kernels are built (``has_panels``), repacked
        into panels of 16 rows (a new tensor of raw's shape, type id 100 + qtype), which one kernel multiplies at every
        row count, a row's bits the same whatever shares its call; anything else as it is. The float32 kernels
        (matmul_f32) do not read a repacked weight. ``copied`` is called with each slice of raw's rows once the copy
        holds it (to let a file's pages go before the next slice is read)."""
        k = self.in_features(qtype, raw) if 100 + qtype in GGUF_PANELS else 0
        if not self.has_panels or not fits_panels(qtype, raw.shape[0], k):
            return qtype, raw
        raw = raw.contiguous()
        out = torch.empty_like(raw)
        for first in range(0, raw.shape[0], _PACK_ROWS):
            part = raw[first : first + _PACK_ROWS]
            packed = self._pack(qtype, part.data_ptr(), out[first:].data_ptr(), part.shape[0], k)
            if packed < 0:
                return qtype, raw
            if copied is not None:
                copied(part)
        return packed, out

    def unpack_rows(self, qtype: int, raw: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of a weight as the file stores them, [len(ids), bytes a row] uint8 (a repacked one's
        rows put back in order; another's, its rows)."""
        if qtype not in GGUF_PANELS:
            return raw.index_select(0, ids)
        ids = ids.to(torch.int64).contiguous()
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= raw.shape[0]):
            raise IndexError(f"row ids must lie in [0, {raw.shape[0]})")
        out = raw.new_empty(len(ids), raw.shape[1])
        k = self.in_features(qtype, raw)
        _check_type(self._unpack(qtype, raw.data_ptr(), ids.data_ptr(), len(ids), k, out.data_ptr()), qtype)
        return out

    @staticmethod
    def in_features(qtype: int, raw: torch.Tensor) -> int:
        """K of a weight stored as ``raw`` [N, bytes a row] in ``qtype``'s blocks."""
        if qtype not in _BLOCK_SIZES:
            _check_type(-1, qtype)
        elems, nbytes = _BLOCK_SIZES[qtype]
        if qtype - 100 in _PAIRED:  # their panels hold blocks in pairs: a unit of two
            elems, nbytes = 2 * elems, 2 * nbytes
        if raw.dim() != 2 or raw.dtype != torch.uint8 or raw.shape[1] % nbytes:
            raise ValueError(f"raw must be uint8 [N, a multiple of {nbytes} bytes], got {raw.dtype} {list(raw.shape)}")
        return raw.shape[1] // nbytes * elems

    @staticmethod
    def activation_block(qtype: int) -> int:
        """Elements per int8 rounding of the activations: 256 (Q8_K) for the K-quants, 32 (Q8_0) else."""
        return _BLOCK_SIZES[qtype][0]

    def quantize(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [M, K] float32 contiguous rounded per ``block`` (256 or 32) elements as the a8 kernels round it:
        (q int8 [M, K], d float32 [M, K / block], sums of q per 16 int16 [M, K / 16]); x ~ q * d."""
        m, k = x.shape
        q = torch.empty(m, k, dtype=torch.int8)
        d = x.new_empty(m, k // block)
        sums = torch.empty(m, k // 16, dtype=torch.int16)
        self._quantize(x.data_ptr(), m, k, block, q.data_ptr(), d.data_ptr(), sums.data_ptr(), None)
        return q, d, sums

    def round_activations(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """x [M, K] float32 contiguous as the a8 kernels see it: q * d (float32 [M, K])."""
        out = torch.empty_like(x)
        self._quantize(x.data_ptr(), x.shape[0], x.shape[1], block, None, None, None, out.data_ptr())
        return out

    def to_groups(self, qtype: int, raw: np.ndarray) -> tuple[str, tuple[torch.Tensor, ...]]:
        """``raw`` (uint8 [N, bytes a row], C-contiguous) of a type in GROUP_LAYOUTS in pagedllm's int4 / int8
        group layout: ``(kind, (q, scales, mins))`` as gguf_loader._q_blocks makes it, bit for bit."""
        import numpy as np

        if qtype not in GROUP_LAYOUTS:
            raise ValueError(f"gguf_blocks.c has no group layout for ggml type {qtype}; it has {sorted(GROUP_LAYOUTS)}")
        kind, elems, nbytes = GROUP_LAYOUTS[qtype]
        if raw.ndim != 2 or raw.dtype != np.uint8 or raw.shape[1] % nbytes or not raw.flags.c_contiguous:
            shape = f"{raw.dtype} {list(raw.shape)}"
            raise ValueError(f"raw must be C-contiguous uint8 [N, a multiple of {nbytes} bytes], got {shape}")
        n, k = raw.shape[0], raw.shape[1] // nbytes * elems
        q = torch.empty(n, k // 2 if kind == "int4" else k, dtype=torch.uint8 if kind == "int4" else torch.int8)
        scales = torch.empty(n, k // 16 if qtype == 14 else k // 32, dtype=torch.float32)
        mins = torch.empty(n, k // 32, dtype=torch.float32)
        src = raw.ctypes.data if raw.size else None
        _check_type(self._to_groups(qtype, src, n, k, q.data_ptr(), scales.data_ptr(), mins.data_ptr()), qtype)
        return kind, (q, scales, mins)

    def matmul_a8(
        self, qtype: int, x: torch.Tensor, raw: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [M, K] float32 contiguous, rounded per activation_block(qtype), @ W^T: [M, N] (into ``out`` where given:
        float32 [M, N], contiguous); meant for few rows, or for any where W is in panels."""
        return self._gemv(self._matmul_a8, qtype, x, raw, out)

    def matmul_a8_parts(
        self, qtypes: list[int], x: torch.Tensor, raws: list[torch.Tensor], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [M, K] float32 contiguous @ [W_0; W_1; ...]^T: [M, sum of N_p], part p's columns matmul_a8(qtypes[p],
        x, raws[p]) bit for bit, with x rounded once per block size (a fused projection's shards, one call); into
        ``out`` where given, as matmul_a8."""
        for q in qtypes:  # the file's layout of a type read only in panels (Q4_0, Q4_1, Q5_K) is not multiplied either
            if q not in GGUF_BLOCKS and q not in GGUF_PANELS:
                _check_type(-1, q)
        ks = {self.in_features(q, r) for q, r in zip(qtypes, raws, strict=True)}
        if ks != {x.shape[1]}:
            raise ValueError(f"x has {x.shape[1]} features, the weights' rows {sorted(ks)}")
        n = len(raws)
        types = (ctypes.c_int * n)(*qtypes)
        ptrs = (ctypes.c_void_p * n)(*(r.data_ptr() for r in raws))
        ns = (ctypes.c_int64 * n)(*(r.shape[0] for r in raws))
        y = _output(out, x, x.shape[0], sum(r.shape[0] for r in raws))
        rc = self._matmul_a8_parts(n, types, ptrs, ns, x.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1])
        _check_type(rc, qtypes[0])  # only -2 (out of memory) is left: every type was checked above
        return y

    def matmul_f32(self, qtype: int, x: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 contiguous @ W_dequantized^T: [M, N]; meant for few rows."""
        return self._gemv(self._matmul_f32, qtype, x, raw)

    def matmul_q8(
        self, qtype: int, q: torch.Tensor, d: torch.Tensor, sums: torch.Tensor, raw: torch.Tensor
    ) -> torch.Tensor:
        """matmul_a8 of activations already rounded by ``quantize(x, activation_block(qtype))``."""
        y = torch.empty(q.shape[0], raw.shape[0], dtype=torch.float32)
        m, n, k = q.shape[0], raw.shape[0], self.in_features(qtype, raw)
        ptrs = (q.data_ptr(), d.data_ptr(), sums.data_ptr(), raw.data_ptr(), y.data_ptr())
        _check_type(self._matmul_q8(qtype, *ptrs, m, n, k), qtype)
        return y

    def _gemv(
        self, fn, qtype: int, x: torch.Tensor, raw: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        k = self.in_features(qtype, raw)
        if x.shape[1] != k:
            raise ValueError(f"x has {x.shape[1]} features, the weight's rows {k}")
        y = _output(out, x, x.shape[0], raw.shape[0])
        _check_type(fn(qtype, x.data_ptr(), raw.data_ptr(), y.data_ptr(), x.shape[0], raw.shape[0], k), qtype)
        return y

    def matmul_half(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 contiguous @ W^T: [M, N], W [N, K] float16 or bfloat16 (contiguous) widened exactly and
        multiplied in float32, each row of x alone (its bits the same at every M); meant for few rows."""
        if w.dtype not in (torch.float16, torch.bfloat16) or w.dim() != 2 or not w.is_contiguous():
            raise ValueError(f"w must be contiguous float16 or bfloat16 [N, K], got {w.dtype} {list(w.shape)}")
        if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] != w.shape[1]:
            raise ValueError(f"x must be contiguous float32 [M, {w.shape[1]}], got {x.dtype} {list(x.shape)}")
        y = x.new_empty(x.shape[0], w.shape[0])
        bf16 = int(w.dtype == torch.bfloat16)
        self._matmul_half(bf16, x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], w.shape[0], w.shape[1])
        return y

    def pack_bf16(self, w: torch.Tensor) -> torch.Tensor | None:
        """W [N, K] bfloat16 repacked into panels of 16 rows for ``matmul_bf16_dot`` (a new tensor of w's shape and
        bytes, permuted), or None where that does not apply (no AVX512_BF16, N not a multiple of 16, K odd)."""
        if w.dtype != torch.bfloat16 or w.dim() != 2:
            raise ValueError(f"w must be bfloat16 [N, K], got {w.dtype} {list(w.shape)}")
        if not self.has_bf16_dot or w.shape[0] % 16 or w.shape[1] % 2:
            return None
        w = w.contiguous()
        out = torch.empty_like(w)
        return out if self._pack_bf16(w.data_ptr(), out.data_ptr(), w.shape[0], w.shape[1]) == 0 else None

    @staticmethod
    def unpack_bf16(panels: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``ids`` (all by default) of a weight ``pack_bf16`` repacked, as the file stores them."""
        n, k = panels.shape
        v = panels.view(n // 16, k // 2, 16, 2)
        if ids is None:
            return v.permute(0, 2, 1, 3).reshape(n, k)
        return v[ids // 16, :, ids % 16, :].reshape(len(ids), k)

    def matmul_bf16_dot(self, x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 contiguous, rounded to bfloat16, @ W^T in bfloat16 dot products (float32 sums in order
        along K, each row of x alone: its bits the same at every M): [M, N]; W as ``pack_bf16`` made it."""
        n, k = panels.shape
        if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] != k:
            raise ValueError(f"x must be contiguous float32 [M, {k}], got {x.dtype} {list(x.shape)}")
        y = x.new_empty(x.shape[0], n)
        rc = self._matmul_bf16_dot(x.data_ptr(), panels.data_ptr(), y.data_ptr(), x.shape[0], n, k)
        if rc == -2:
            raise MemoryError("gguf_blocks.c could not allocate its working buffers")
        if rc != 0:
            raise ValueError(f"no bfloat16 dot products for a [{n}, {k}] weight on this build")
        return y

    def dequantize(self, qtype: int, raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """W as float32 [N, K], gguf's values bit for bit; into ``out`` (float32, at least N * K elements,
        contiguous) when given."""
        n, k = raw.shape[0], self.in_features(qtype, raw)
        w = torch.empty(n, k, dtype=torch.float32) if out is None else out.view(-1)[: n * k].view(n, k)
        _check_type(self._dequantize(qtype, raw.data_ptr(), w.data_ptr(), n, k), qtype)
        return w


def _output(out: torch.Tensor | None, like: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A kernel's output [rows, cols] float32: ``out`` where given (checked: the kernel writes it by pointer), else
    a new tensor on ``like``'s device."""
    if out is None:
        return like.new_empty(rows, cols)
    if out.shape != (rows, cols) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32 [{rows}, {cols}], got {out.dtype} {list(out.shape)}")
    return out


def _check_type(rc: int, qtype: int) -> None:
    if rc == -2:
        raise MemoryError("gguf_blocks.c could not allocate its working buffers")
    if rc != 0:
        raise ValueError(f"gguf_blocks.c does not read ggml type {qtype}; it reads {sorted(GGUF_BLOCKS)}")


_ZERO_ROW = torch.zeros(1, dtype=torch.int64)  # the block table of K / V handed over as one block


def _digits(bits: int) -> int:
    """Integer activations of ``bits`` bits: how many int8 digits the kernels keep of each."""
    if bits not in (8, 16):
        raise ValueError(f"integer activations are 8 or 16 bits, not {bits}")
    return bits // 8


def _ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's address; None (NULL) for none: the quantized kernels' all-zero mins."""
    return None if t is None else t.data_ptr()
