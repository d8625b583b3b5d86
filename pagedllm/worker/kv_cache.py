"""Sizing and allocating the paged KV cache from a memory budget."""

from __future__ import annotations

import logging
import os

import torch

from pagedllm.attention import kv_int8
from pagedllm.config import CacheConfig, GiB
from pagedllm.errors import InvalidParameterError
from pagedllm.worker.loader import DTYPES

logger = logging.getLogger("pagedllm")

DEFAULT_CPU_KV_CACHE_BYTES = 4 * GiB  # vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE)


_KV_DTYPES = {
    **DTYPES,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """'auto' stores K/V in the model dtype; fp8 variants store unscaled 8-bit floats (scale 1.0, as vLLM's default);
    int8 stores each token's row of a kv head with its own scale (:mod:`pagedllm.attention.kv_int8`)."""
    return model_dtype if name == "auto" else _KV_DTYPES[name]


CUDA_MARGIN_BYTES = 256 << 20  # at least this much of a device's free memory is left outside the KV cache


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    row = kv_int8.row_width(head_dim, dtype) * torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * row


def num_blocks_for_budget(
    cache: CacheConfig,
    device: torch.device,
    per_block: int,
    profiled_peak_bytes: int | None = None,
    wanted_blocks: int | None = None,
) -> int:
    """How many blocks the budget allows: on CUDA gpu_memory_utilization of the device less ``profiled_peak_bytes``
    (the engine's own weights and activations), at most what is free; on CPU :func:`cpu_kv_cache_bytes`
    (``wanted_blocks``: what max_num_seqs requests of max_model_len tokens would fill)."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    if device.type == "cuda":
        # this engine's share of the device, less its weights and activation peak; no more than is free (other
        # engines and processes hold the rest), less a margin for what is allocated later (cuBLAS' workspace,
        # the allocator's rounding)
        free, total = torch.cuda.mem_get_info(device)
        margin = max(CUDA_MARGIN_BYTES, total // 100)
        budget = min(int(total * cache.gpu_memory_utilization) - (profiled_peak_bytes or 0), free - margin)
    else:
        budget = cpu_kv_cache_bytes(cache, per_block, wanted_blocks)
    return max(budget // per_block, 0)


def cpu_kv_cache_bytes(cache: CacheConfig, per_block: int, wanted_blocks: int | None = None) -> int:
    """The CPU KV cache's bytes: ``kv_cache_memory`` where given (else vLLM-CPU's ``VLLM_CPU_KVCACHE_SPACE``, in
    GiB), refused when more than the memory available; otherwise what ``wanted_blocks`` need, at most 4 GiB
    (vLLM-CPU's default) and half the memory available now."""
    asked, setting = cache.kv_cache_memory, "kv_cache_memory"
    env = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if asked is None and env:
        try:
            asked, setting = int(float(env) * GiB), "VLLM_CPU_KVCACHE_SPACE"
        except ValueError:
            raise InvalidParameterError(
                f"VLLM_CPU_KVCACHE_SPACE={env!r} is not a number of GiB", "kv_cache_memory"
            ) from None
    available = available_memory()
    if asked is not None:
        if asked <= 0:
            raise InvalidParameterError(f"{setting} must be positive, got {asked / GiB:g} GiB", "kv_cache_memory")
        if available is not None and asked > available:
            raise InvalidParameterError(
                f"{setting} asks for a {asked / GiB:,.2f} GiB KV cache, but only {available / GiB:,.2f} GiB of "
                "memory is available on this machine; lower it (or max_model_len / max_num_seqs)",
                "kv_cache_memory",
            )
        return asked
    budget = DEFAULT_CPU_KV_CACHE_BYTES
    if wanted_blocks is not None:
        budget = min(budget, wanted_blocks * per_block)
    if available is not None:
        budget = min(budget, available // 2)
    return budget


def available_memory() -> int | None:
    """Bytes of memory the kernel could give this process now without swapping (Linux's MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    prefault: bool = False,
) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, kv_heads, head_dim] view per layer into a single zeroed buffer (int8: rows of
    head_dim + 4, :mod:`pagedllm.attention.kv_int8`).

    On CPU a large buffer is an anonymous memory mapping of its own: the kernel
    zero-fills its pages on first touch, so a 4 GiB cache costs resident memory
    only for the blocks actually written. (``torch.empty`` is not enough: the C
    allocator may serve even a large request from memory freed earlier, dirty, as
    CI once caught.) Small buffers are zeroed explicitly. Unwritten slots must read
    as zeros, never NaN: attention multiplies masked-out values by 0.
    The free queue hands out the most recently freed empty block first, so the cache's
    resident memory is that of the most blocks ever in use at once, plus the prefix
    cache's blocks; ``prefault`` makes it all resident at once (``torch.zeros`` writes
    every page).
    """
    row = kv_int8.row_width(head_dim, dtype)
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, row)
    numel = num_layers * 2 * num_blocks * block_size * num_kv_heads * row
    itemsize = torch.empty((), dtype=dtype).element_size()
    try:
        if device.type == "cpu" and numel * itemsize >= _FRESH_MMAP_BYTES and not prefault:
            import mmap

            # the tensor keeps the mapping alive; it is unmapped when the last view goes
            buf = torch.frombuffer(mmap.mmap(-1, numel * itemsize), dtype=torch.uint8).view(dtype).view(shape)
        else:
            buf = torch.zeros(shape, dtype=dtype, device=device)
    except (OSError, OverflowError, RuntimeError) as e:  # more than the machine maps or holds
        raise InvalidParameterError(
            f"the KV cache ({numel * itemsize / GiB:,.1f} GiB in {num_blocks} blocks) could not be allocated on "
            f"{device} ({e}); lower kv_cache_memory (or gpu_memory_utilization)",
            "kv_cache_memory",
        ) from e
    return list(buf.unbind(0))


# below this, zeroing the buffer at once costs little
_FRESH_MMAP_BYTES = 256 << 20
