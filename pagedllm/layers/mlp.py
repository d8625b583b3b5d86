"""The gated MLP the model families and the MoE experts share."""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import kernels
from pagedllm.distributed import ParallelState
from pagedllm.errors import UnsupportedModelError
from pagedllm.layers.linear import thread_buffer

# rows of x at a time through gate|up, the activation and down where both compute each row alone (GGUF panels): a
# 512-token prefill chunk of Qwen2.5-1.5B holds 53 MiB of intermediate activations at once (gate|up 35, the
# activation 18), a 2,048-token one 210; 256 rows hold 26. Its Q4_K_M file's 512- and 2,048-token prefills took 1.01x
# and 1.02x the time in runs of 256 (128: 1.09x and 1.05x; medians of 3, alternated in one process, 2-core Xeon),
# and its peak RSS over real_size.py's runs fell 52 MiB. Not other layers: past a few rows those widen their whole
# weight at each call (quantized groups, gguf-exact), and a float GEMM's rows may round otherwise in a smaller one
MLP_ROWS = 256

# gate|up and the activation of GatedMLP._local where gate|up computes each row alone (GGUF panels), per thread: one
# float32 buffer grown to the largest call (a 256-row run of Qwen2.5-1.5B: 26 MiB), reused by every layer and step;
# not quantized_scratch's, which a down projection outside the panels widens its weight into while it reads this.
# Allocated afresh at each call, the two (17.5 and 8.8 MiB) left holes in the C heap that the next ones did not fit:
# a 512-token prefill of that model's Q2_K file grew the heap by 70 MiB where 16 more were in use after it
_SCRATCH = threading.local()


def _scratch(rows: int, intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate|up [rows, 2 intermediate], activation [rows, intermediate]): float32 views of this thread's buffer,
    valid until its next call."""
    need = 3 * rows * intermediate
    buf = thread_buffer(_SCRATCH, need)
    split = 2 * rows * intermediate
    return buf[:split].view(rows, 2 * intermediate), buf[split:need].view(rows, intermediate)


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
        n = x.shape[0] if x.dim() == 2 else 0
        # the row count first: a decode step's few rows never ask the linears. rows_alone: GGUFLinear's; a LoRA
        # linear has none (its row segments index the whole step's rows)
        if (
            n <= MLP_ROWS
            or x.device.type != "cpu"
            or not all(getattr(p, "rows_alone", False) for p in (self.gate_up_proj, self.down_proj))
        ):
            return self.ps.all_reduce(self._local(x))
        out = x.new_empty(n, self.down_proj.out_features)  # each row's output is computed alone: runs of MLP_ROWS
        for i in range(0, n, MLP_ROWS):
            out[i : i + MLP_ROWS] = self._local(x[i : i + MLP_ROWS])
        return self.ps.all_reduce(out)

    def _local(self, x):
        """This rank's share of the block's output for rows x (before the all-reduce)."""
        into = getattr(self.gate_up_proj, "forward_into", None)
        k = kernels.for_tensor(x) if into is not None and x.dim() == 2 else None
        if k is not None and self.gate_up_proj.rows_alone and self.gate_up_proj.bias is None:
            # gate|up and the activation in this thread's buffer (_SCRATCH), the same bits
            gate_up, act = _scratch(x.shape[0], self.intermediate)
            into(x, gate_up)
            return self.down_proj(k.silu_mul(gate_up, out=act))
        gate_up = self.gate_up_proj(x)
        k = kernels.for_tensor(gate_up)
        if k is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
            return self.down_proj(k.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
