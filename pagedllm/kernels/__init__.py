"""Small C kernels PyTorch lacks on CPU, compiled on first use and loaded with ctypes.

``quant_matmul.c`` (int4 / int8 weight-only matmuls), ``paged_attention.c``
(decode and prefill attention read in place from the paged cache) and ``elementwise.c``
(fused residual add + RMSNorm, SiLU*mul, rotary) and ``decode_loop.c`` (a decode step's layer loop over
them, :mod:`pagedllm.models.fused_decode`) are built with the system C compiler (``$CC``, default ``cc``)
into ``$PAGEDLLM_CACHE_DIR/kernels/<hash of sources, flags, compiler, CPU>.so``; later runs load the cached
file. The build is for one instruction-set level (:mod:`pagedllm.kernels.isa`: the best this CPU and OS run,
or ``$PAGEDLLM_CPU_LEVEL``) and uses OpenMP from the libgomp PyTorch has already loaded, so the kernels'
threads are PyTorch's.

Without a working compiler, attention and the fused ops fall back to plain torch
(one warning) and ``quantization`` is refused with the compiler's message.
"""

from pagedllm.kernels.build import KernelBuildError, build_in_background, for_tensor, load, try_load
from pagedllm.kernels.ops import KV_DTYPES, MAX_BLOCK_SIZE, MAX_GROUP, MAX_HEAD_DIM, Kernels

__all__ = [
    "KV_DTYPES",
    "MAX_BLOCK_SIZE",
    "MAX_GROUP",
    "MAX_HEAD_DIM",
    "KernelBuildError",
    "Kernels",
    "build_in_background",
    "for_tensor",
    "load",
    "try_load",
]
