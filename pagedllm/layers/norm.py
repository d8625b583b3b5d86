from __future__ import annotations

import torch
from torch import nn

from pagedllm import kernels


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as transformers does), optionally fused with the residual add."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        k = kernels.for_tensor(x)
        if (
            k is not None
            and x.dim() == 2
            and x.is_contiguous()
            and self.weight.dtype == torch.float32
            and (
                residual is None
                or (residual.is_contiguous() and residual.shape == x.shape and residual.dtype == x.dtype)
            )
        ):
            out = k.add_rms_norm(x, residual, self.weight, self.eps)  # one pass; the sum lands in x
            return out if residual is None else (out, x)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()  # no copy when x is already float32
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
