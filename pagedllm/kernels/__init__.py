"""Small C kernels PyTorch lacks on CPU, compiled on first use and loaded with ctypes.

``quant_matmul.c`` (int4 / int8 weight-only matmuls), ``paged_attention.c``
(decode and prefill attention read in place from the paged cache) and ``elementwise.c``
(fused residual add + RMSNorm, SiLU*mul, rotary) and ``decode_loop.c`` (a decode step's layer loop over
them, :mod:`pagedllm.models.fused_decode`) are built with the system C compiler (``$CC``, default ``cc``) into ``$PAGEDLLM_CACHE_DIR/kernels/<hash of
sources, flags, compiler, CPU>.so``; later runs load the cached file. The build
is for this machine (``-march=native``) and uses OpenMP from the libgomp PyTorch
has already loaded, so the kernels' threads are PyTorch's.

Without a working compiler, attention and the fused ops fall back to plain torch
(one warning) and ``quantization`` is refused with the compiler's message.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time

import torch

logger = logging.getLogger("pagedllm")

_DIR = os.path.dirname(__file__)
_SOURCES = [os.path.join(_DIR, f) for f in ("quant_matmul.c", "paged_attention.c", "elementwise.c", "decode_loop.c")]
_HEADERS = [os.path.join(_DIR, "vec_math.h")]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]

# limits of paged_attention.c's stack buffers, and the cache dtypes it reads (its kv_dtype codes)
MAX_GROUP, MAX_BLOCK_SIZE, MAX_HEAD_DIM = 32, 64, 256  # MAX_TASK_HEADS, MAX_BS, MAX_D
KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 2}


@functools.cache
def _fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """The float32 value of each of the 256 bytes of an fp8 format."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float().contiguous()


class Kernels:
    def __init__(self, lib: ctypes.CDLL):
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
        self._prefill_attn.argtypes = [p, i64, p, p, i64, i64, p, i64, i64, p, i64, i64, i64, i64, i64,
                                       ctypes.c_float, i64, ctypes.c_int, p]
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
        self._attn.argtypes = [p, i64, p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, ctypes.c_float,
                               ctypes.c_int, p]
        self._f32_matmul = lib.f32_matmul
        self._f32_matmul.argtypes = [p, p, p, i64, i64, i64]
        self._f32_matmul.restype = None
        self._decode_layers = lib.decode_layers
        self._decode_layers.argtypes = [p, i64, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, p, p, p, p, p,
                                        i64, p, i64, ctypes.c_float]
        self._decode_layers.restype = ctypes.c_int
        for fn in (self._matmul, self._dequant, self._matmul8, self._dequant8, self._attn, self._norm,
                   self._silu_mul, self._rotary, self._matmul_a8, self._matmul8_a8, self._quantize_q8,
                   self._matmul8_g16, self._dequant8_g16):
            fn.restype = None

    def paged_decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, starts: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [nd, H, D] float32 (rows may be strided, heads and dims contiguous); kv_cache: one layer's
        [2, num_blocks, bs, KVH, D] in a dtype of KV_DTYPES; block_tables [>= nd, M], seq_lens and
        starts [nd] int64."""
        nd, h, d = q.shape
        _, _, bs, kvh, _ = kv_cache.shape
        code = KV_DTYPES[kv_cache.dtype]
        lut = _fp8_table(kv_cache.dtype) if code == 2 else None
        out = q.new_empty(nd, h, d)
        self._attn(q.data_ptr(), q.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                   block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), starts.data_ptr(),
                   out.data_ptr(), nd, h, kvh, d, bs, scale, code, lut.data_ptr() if lut is not None else None)
        return out

    def paged_prefill_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, block_row: torch.Tensor, ctx: int,
                                scale: float, window: int | None, out: torch.Tensor) -> None:
        """One request's queries q [Q, H, D] float32 (rows may be strided, heads and dims contiguous) at positions
        ctx .. ctx + Q - 1, attending their own and earlier positions (within ``window``) of one layer's
        kv_cache [2, num_blocks, bs, KVH, D] through block_row [>= blocks] int64, into out [Q, H, D] (rows may
        be strided), in place."""
        _, _, bs, kvh, d = kv_cache.shape
        code = KV_DTYPES[kv_cache.dtype]
        lut = _fp8_table(kv_cache.dtype) if code == 2 else None
        self._prefill(q, kv_cache[0], kv_cache[1], kvh * d, kvh * d, block_row, ctx, bs, scale, window, out, code,
                      lut)

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          window: int | None, out: torch.Tensor) -> None:
        """As paged_prefill_attention with nothing cached before the queries: their own K / V [Q, KVH, D]
        float32 (rows may be strided; heads and dims contiguous)."""
        self._prefill(q, k, v, k.stride(0), v.stride(0), _ZERO_ROW, 0, max(q.shape[0], 1), scale, window, out, 0,
                      None)

    def _prefill(self, q, k, v, k_stride: int, v_stride: int, table: torch.Tensor, ctx: int, bs: int, scale: float,
                 window: int | None, out: torch.Tensor, code: int, lut: torch.Tensor | None) -> None:
        n, h, d = q.shape
        self._prefill_attn(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k_stride, v_stride,
                           table.data_ptr(), ctx, n, out.data_ptr(), out.stride(0), h, k.shape[-2], d, bs, scale,
                           window or 0, code, lut.data_ptr() if lut is not None else None)

    def decode_layers(self, layers, n_layers: int, x: torch.Tensor, out: torch.Tensor, t: int, hidden: int,
                      heads: int, kv_heads: int, head_dim: int, inter: int, eps: float, final_norm: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, block_size: int, scale: float) -> int:
        """A decode step's layers (decode_loop.c; ``layers`` a ctypes array of its DecodeLayer). 0 or -1."""
        return self._decode_layers(ctypes.byref(layers), n_layers, x.data_ptr(), out.data_ptr(), t, hidden, heads,
                                   kv_heads, head_dim, inter, eps, final_norm.data_ptr(), cos.data_ptr(),
                                   sin.data_ptr(), slots.data_ptr(), block_tables.data_ptr(),
                                   block_tables.stride(0), seq_lens.data_ptr(), block_size, scale)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """x, residual: [T, n] float32 contiguous; x becomes x + residual in place; returns the norm."""
        out = torch.empty_like(x)
        self._norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                   out.data_ptr(), x.shape[0], x.shape[1], eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2 I] float32 contiguous; returns silu(gate) * up, [T, I]."""
        t, two_i = gate_up.shape
        out = gate_up.new_empty(t, two_i // 2)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2)
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] float32 with heads and dims contiguous (rows may be strided); cos, sin
        [T, 1, D/2] contiguous; returns the rotated heads, contiguous."""
        t, heads, d = x.shape
        out = x.new_empty(t, heads, d)
        self._rotary(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), t, heads, d)
        return out

    def int4_matmul(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    mins: torch.Tensor) -> torch.Tensor:
        """x: [M, K] float32 contiguous; qweight [N, K/2] uint8, scales / mins [N, K/32]; returns [M, N]."""
        return self._quant_matmul(self._matmul, x, qweight, scales, mins)

    def int8_matmul(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    mins: torch.Tensor) -> torch.Tensor:
        """x: [M, K] float32 contiguous; qweight [N, K] int8, scales / mins [N, K/32]; returns [M, N]."""
        return self._quant_matmul(self._matmul8, x, qweight, scales, mins)

    def int8_matmul_g16(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        mins: torch.Tensor) -> torch.Tensor:
        """As int8_matmul with a scale per 16 weights (GGUF's Q6_K): scales [N, K/16], mins [N, K/32]."""
        return self._quant_matmul(self._matmul8_g16, x, qweight, scales, mins)

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

    def int4_matmul_a8(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       mins: torch.Tensor) -> torch.Tensor:
        """As int4_matmul, with each row of x first rounded to int8 per group of 32 (GGUF's Q8_0: scale
        max|x| / 127); the mins multiply the groups' exact float sums. Any number of rows."""
        return self._quant_matmul(self._matmul_a8, x, qweight, scales, mins, 1)

    def int8_matmul_a8(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       mins: torch.Tensor) -> torch.Tensor:
        """As int8_matmul, with x rounded to int8 as in int4_matmul_a8."""
        return self._quant_matmul(self._matmul8_a8, x, qweight, scales, mins, 1)

    def int4_matmul_a16(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        mins: torch.Tensor) -> torch.Tensor:
        """As int4_matmul_a8 with x rounded to int16 per group of 32 (scale max|x| / 32512), multiplied as
        two int8 digits."""
        return self._quant_matmul(self._matmul_a8, x, qweight, scales, mins, 2)

    def int8_matmul_a16(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        mins: torch.Tensor) -> torch.Tensor:
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
    def _quant_matmul(fn, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      mins: torch.Tensor, *digits: int) -> torch.Tensor:
        y = x.new_empty(x.shape[0], qweight.shape[0])
        fn(x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), _ptr(mins), y.data_ptr(), x.shape[0],
           qweight.shape[0], x.shape[1], *digits)
        return y

    def int4_dequantize(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        return self._quant_dequantize(self._dequant, qweight, scales, mins, qweight.shape[1] * 2, out)

    def int8_dequantize(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        return self._quant_dequantize(self._dequant8, qweight, scales, mins, qweight.shape[1], out)

    def int8_dequantize_g16(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                            out: torch.Tensor | None = None) -> torch.Tensor:
        return self._quant_dequantize(self._dequant8_g16, qweight, scales, mins, qweight.shape[1], out)

    @staticmethod
    def _quant_dequantize(fn, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, k: int,
                          out: torch.Tensor | None) -> torch.Tensor:
        """Into ``out`` (float32, at least N * K elements, contiguous) when given, else a new tensor."""
        n = qweight.shape[0]
        w = torch.empty(n, k, dtype=torch.float32) if out is None else out.view(-1)[:n * k].view(n, k)
        fn(qweight.data_ptr(), scales.data_ptr(), _ptr(mins), w.data_ptr(), n, k)
        return w


_ZERO_ROW = torch.zeros(1, dtype=torch.int64)  # the block table of K / V handed over as one block


def _digits(bits: int) -> int:
    """Integer activations of ``bits`` bits: how many int8 digits the kernels keep of each."""
    if bits not in (8, 16):
        raise ValueError(f"integer activations are 8 or 16 bits, not {bits}")
    return bits // 8


def _ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's address; None (NULL) for none: the quantized kernels' all-zero mins."""
    return None if t is None else t.data_ptr()


_BUILD_LOCK = threading.Lock()


@functools.cache
def load() -> Kernels:
    """Build (once per source version) and load the kernels; raises KernelBuildError when that fails."""
    from pagedllm.model_loader.cache import cache_root

    cc = os.environ.get("CC", "cc")
    # -march=native: a cache shared between machines must not hand one CPU's build to another
    digest = hashlib.sha256(" ".join([cc, *_FLAGS, platform.machine(), _cpu_flags()]).encode())
    for src in _SOURCES + _HEADERS:
        with open(src, "rb") as f:
            digest.update(f.read())
    out_dir = os.path.join(cache_root(), "kernels")
    path = os.path.join(out_dir, f"pagedllm-kernels-{digest.hexdigest()[:16]}.so")
    with _BUILD_LOCK:  # one build per process: a second caller waits for it (e.g. the background build)
        if not os.path.exists(path):
            if shutil.which(cc) is None:
                raise KernelBuildError(f"pagedllm's C kernels are compiled on first use, but no C compiler "
                                       f"({cc!r}; set $CC) was found")
            _build(cc, out_dir, path)
    try:
        return Kernels(ctypes.CDLL(path))
    except OSError as e:  # e.g. a cached build this system can no longer load
        raise KernelBuildError(f"loading pagedllm's C kernels from {path} failed: {e}") from e


def _build(cc: str, out_dir: str, path: str) -> None:
    """Compile each source in its own process (in parallel), then link; the .so appears atomically."""
    logger.info("compiling pagedllm's C kernels for this CPU (once; cached in %s)", out_dir)
    t0 = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        objects = [os.path.join(tmp, os.path.basename(src) + ".o") for src in _SOURCES]
        compile_flags = [f for f in _FLAGS if f != "-shared"]
        compiles = [subprocess.Popen([cc, *compile_flags, "-c", src, "-o", obj], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True) for src, obj in zip(_SOURCES, objects)]
        steps = [(proc, proc.communicate()[1]) for proc in compiles]
        so = os.path.join(tmp, "kernels.so")
        if all(proc.returncode == 0 for proc, _ in steps):
            link = subprocess.run([cc, *_FLAGS, *objects, "-o", so], capture_output=True, text=True)
            steps.append((link, link.stderr))
        failed = [err for proc, err in steps if proc.returncode != 0]
        if failed:
            raise KernelBuildError(f"building pagedllm's C kernels failed ({cc} {' '.join(_FLAGS)}):\n"
                                   f"{failed[0].strip()}")
        os.replace(so, path)  # atomic: a concurrent loader sees no file or a whole one
    logger.info("compiled pagedllm's C kernels in %.1fs", time.perf_counter() - t0)


def build_in_background() -> None:
    """Start building the kernels on a thread, so the compiler runs while the model loads."""
    threading.Thread(target=try_load, name="pagedllm-kernel-build", daemon=True).start()


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


class KernelBuildError(RuntimeError):
    pass


def for_tensor(x: torch.Tensor) -> Kernels | None:
    """The kernels where ``x`` is a float32 CPU tensor outside autograd and they could be built, else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.requires_grad:
        return None
    return try_load()


@functools.cache
def try_load() -> Kernels | None:
    """The kernels, or None (with one warning) where they cannot be built: callers fall back to torch."""
    try:
        return load()
    except KernelBuildError as e:
        logger.warning("%s; using the plain-torch paths instead", e)
        return None
