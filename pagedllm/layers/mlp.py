"""The gated MLP the model families and the MoE experts share."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import nn

from pagedllm import kernels
from pagedllm.distributed import ParallelState
from pagedllm.errors import UnsupportedModelError


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: Llama's MLP, each expert of a :class:`~pagedllm.layers.fused_moe.FusedMoE`,
    and (with another activation) Gemma 3's. Column-parallel gate|up, row-parallel down: one all-reduce under
    tensor parallelism."""

    activations: tuple[str, ...] = ("silu",)  # the config's hidden_act values this block computes

    def __init__(self, cfg: Any, ps: ParallelState | None = None, intermediate_size: int | None = None):
        super().__init__()
        act = getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", None) or self.activations[0]
        if act not in self.activations:
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; only {', '.join(self.activations)}")
        bias = getattr(cfg, "mlp_bias", False)
        self.ps = ps or ParallelState()
        self.intermediate = (intermediate_size or cfg.intermediate_size) // self.ps.tp_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = nn.Linear(self.intermediate, cfg.hidden_size, bias=bias)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        k = kernels.for_tensor(gate_up)
        if k is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
            return self.ps.all_reduce(self.down_proj(k.silu_mul(gate_up)))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.ps.all_reduce(self.down_proj(F.silu(gate) * up))
