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

import torch
from torch import nn


@functools.cache
def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + b through oneDNN; ``weight`` is packed (``PackedLinear``) or a plain float32 [N, K]."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's blocked layout (float32, CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous()),
                             persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN packed"


def pack_linears(model: nn.Module) -> None:
    """Replace every float32 ``nn.Linear`` of a CPU model by a :class:`PackedLinear`, in place; a tied
    head gets a packed copy of the embedding (the embedding itself stays for lookups)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32:
                setattr(module, name, PackedLinear(child.weight, child.bias))
    if getattr(model, "tie_word_embeddings", False) and model.lm_head is None \
            and model.embed_tokens.weight.dtype == torch.float32:
        model.lm_head = PackedLinear(model.embed_tokens.weight, None)
