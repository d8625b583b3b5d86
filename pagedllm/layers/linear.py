"""float32 linears on CPU through oneDNN, with each weight packed once at load time.

``F.linear`` on CPU calls MKL's GEMM, which re-lays out the weight on every call
and, on this project's AMD machines, reaches 60-70 GFLOP/s for a 64-row decode
batch and streams a single-row decode at well under memory bandwidth. oneDNN's
linear over a weight reordered once into its blocked layout (the path
PyTorch's own inductor uses for frozen CPU weights) measured 1.9x MKL for 64 rows and
1.7x for one row across SmolLM2's projections and head (``python benchmarks/cpu_kernels.py
linear``). It computes the same products in another summation order.
"""

from __future__ import annotations

import functools
import os
import threading

import torch
from torch import nn

# Primitives each of oneDNN's and ideep's caches may hold. oneDNN makes a primitive per (weight shape,
# row count), and an engine's flattened batches take hundreds of row counts, so torch's default of 1024
# entries per cache, at 0.3-0.6 MiB an entry for SmolLM2's shapes, lets a server's RSS grow for hours:
# the 30-minute soak grew ~14 MiB a minute through them and the heap fragmented around them. 128 holds
# the row counts of steady decode (a miss costs ~0.3 ms, which the 25+ ms step hardly sees).
ONEDNN_CACHE_CAPACITY = 128


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Cap oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and the LRU cache of ideep,
    torch's oneDNN layer (``LRU_CACHE_CAPACITY``), at ``capacity`` entries each. Both are read once, at
    the process's first oneDNN primitive, so this runs before the model is built; an operator's own
    value of either variable is kept."""
    for var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(var, str(capacity))


@functools.cache
def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + b through oneDNN; ``weight`` is packed (``PackedLinear``) or a plain float32 [N, K]."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


GEMV_ROWS = 4  # rows at most for pagedllm's own float32 kernel (kernels.f32_matmul); above, oneDNN


@functools.cache
def gemv_kernels(n: int, k: int):
    """pagedllm's kernels where their float32 GEMV sums every element of an [n, k] weight's product in
    oneDNN's order (checked here, once per shape: oneDNN picks its algorithm by shape), else None: then
    every row count goes to oneDNN, so that a row's result never depends on its batch's size
    (speculative decoding's verified rows and plain decode rows must see the same logits)."""
    from pagedllm import kernels

    kern = kernels.try_load()
    if kern is None or not onednn_available():
        return None
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(n, k, generator=gen), torch.randn(3, k, generator=gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    ref = onednn_linear(x, packed, None)
    if not all(torch.equal(kern.f32_matmul(x[:m], kern.f32_panels(w), n), ref[:m]) for m in (1, 3)):
        import logging

        logging.getLogger("pagedllm").debug(
            "oneDNN sums a [%d, %d] weight's products in another order here: its decode rows use oneDNN too", n, k
        )
        return None
    return kern


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's blocked layout (float32, CPU) for GEMMs, and for decode
    (``gemv``, up to GEMV_ROWS rows) also as panels that ``kernels.f32_matmul`` streams: 2.4x oneDNN on
    one row of SmolLM2's layers, with the very same sums. The second copy doubles the weight's memory;
    the logits head goes without it (oneDNN is within 1.2x there)."""

    # buffers (register_buffer): typed here, as nn.Module's __getattr__ does not know them
    packed: torch.Tensor
    bias: torch.Tensor | None
    panels: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gemv: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        plain = weight.detach().float().contiguous()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(plain), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)
        self._kernels = gemv_kernels(self.out_features, self.in_features) if gemv else None
        self.register_buffer(
            "panels", None if self._kernels is None else self._kernels.f32_panels(plain), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self._kernels is not None
            and x.dim() == 2
            and x.shape[0] <= GEMV_ROWS
            and x.dtype == torch.float32
            and not x.requires_grad
        ):
            y = self._kernels.f32_matmul(x.contiguous(), self.panels, self.out_features)
            return y if self.bias is None else y.add_(self.bias)
        return onednn_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN packed"


def pack_linears(model: nn.Module) -> None:
    """Replace every float32 ``nn.Linear`` of a CPU model by a :class:`PackedLinear`, in place; a tied
    head gets a packed copy of the embedding (the embedding itself stays for lookups)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32:
                setattr(module, name, PackedLinear(child.weight, child.bias, gemv=name != "lm_head"))
    if (
        getattr(model, "tie_word_embeddings", False)
        and model.lm_head is None
        and model.embed_tokens.weight.dtype == torch.float32
    ):
        model.lm_head = PackedLinear(model.embed_tokens.weight, None)


SMALL_BATCH = 8  # rows at most for the quantized linears' direct kernels; above, unpack once and use the GEMM
_SCRATCH = threading.local()


def thread_buffer(store: threading.local, numel: int) -> torch.Tensor:
    """``store``'s float32 buffer for this thread, at least ``numel`` long: grown to the largest asked for, the
    old one freed before the new one is made."""
    buf = getattr(store, "buf", None)
    if buf is None or buf.numel() < numel:
        store.buf = None
        buf = store.buf = torch.empty(numel, dtype=torch.float32)
    return buf


def quantized_scratch(numel: int) -> torch.Tensor:
    """One float32 buffer per thread shared by every quantized linear's batched path, grown to the
    largest weight: a fresh allocation each call costs a page fault per 4 KiB on first touch, which
    for the head (113 MB) took longer than the unpacking itself."""
    return thread_buffer(_SCRATCH, numel)


def float_bias(bias: torch.Tensor | None) -> nn.Parameter | None:
    """A quantized layer's float32 bias, a parameter by the float layer's name: a checkpoint's bias loads into it
    after the layer took its block."""
    return None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
