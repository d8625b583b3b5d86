from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as transformers does), optionally fused with the residual add."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()  # no copy when x is already float32
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
