"""A sparse Mixture-of-Experts block: top-k routing, then one grouped matmul per expert.

Routing (as Mixtral and Qwen-MoE define it): softmax over the router's logits in
float32, the top ``k`` experts per token, optionally renormalised to sum to 1.

The experts run grouped: the ``T * k`` (token, expert) pairs are sorted by expert,
the tokens gathered in that order, and each expert that received any runs its
gate|up and down projections once on its contiguous slice of rows. An expert no
token chose costs nothing; nothing loops over tokens. The results, scaled by their
routing weights, are summed back into each token's row with one ``index_add_``.

Each expert is a :class:`~pagedllm.layers.mlp.GatedMLP` of ``nn.Linear`` layers, so
the loader's oneDNN packing and ``--quantization`` (int8 / int4 / w4a8) apply to expert weights
as to any other linear. The router and the shared expert's gate are kept in float32
(:class:`RouterLinear`): quantizing them would move tokens between experts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import ParallelState
from pagedllm.errors import UnsupportedModelError
from pagedllm.layers.mlp import GatedMLP


def local_experts(num_experts: int, ps: ParallelState) -> tuple[int, int]:
    """``(first, count)``: the experts this rank holds whole under expert parallelism (all, without it)."""
    count = num_experts // ps.tp_size
    return ps.tp_rank * count, count


class RouterLinear(nn.Module):
    """``x @ W.T`` that the loader neither packs nor quantizes (a router's logits decide the routing)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class FusedMoE(nn.Module):
    def __init__(
        self,
        cfg: Any,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        shared_intermediate: int = 0,
        ps: ParallelState | None = None,
    ):
        super().__init__()
        self.ps = ps = ps or ParallelState()
        if ps.tp_size > 1 and not ps.expert_parallel:
            raise UnsupportedModelError(
                "tensor parallelism of a Mixture-of-Experts model needs "
                "enable_expert_parallel (its experts are shared out whole)"
            )
        if not 0 < top_k <= num_experts:
            raise UnsupportedModelError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        if num_experts % ps.tp_size:
            raise UnsupportedModelError(f"{ps.tp_size} expert-parallel ranks do not divide {num_experts} experts")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        # expert parallelism: this rank holds experts [first, first + local) whole; every rank routes every
        # token (its input is replicated after attention's all-reduce), runs the pairs of its own experts,
        # and one all-reduce sums the ranks' partial outputs. Rank 0 adds the shared expert.
        self.first_expert, self.num_local = local_experts(num_experts, ps)
        self.gate = RouterLinear(cfg.hidden_size, num_experts)
        self.experts = nn.ModuleList(GatedMLP(cfg, intermediate_size=intermediate_size) for _ in range(self.num_local))
        shared_here = shared_intermediate and ps.tp_rank == 0
        self.shared_expert = GatedMLP(cfg, intermediate_size=shared_intermediate) if shared_here else None
        self.shared_expert_gate = RouterLinear(cfg.hidden_size, 1) if shared_here else None
        self.expert_calls = 0  # expert matmul groups run so far (a test counts them: one per expert per step)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts ``[T, k]`` and their weights ``[T, k]`` (in x's dtype)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        rows = order // self.top_k  # the token of each sorted pair
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        mine = counts[self.first_expert : self.first_expert + self.num_local]
        lo = sum(counts[: self.first_expert])  # this rank's experts' pairs are one contiguous run
        order, rows = order[lo : lo + sum(mine)], rows[lo : lo + sum(mine)]
        gathered = x.index_select(0, rows)
        out = torch.empty_like(gathered)
        start = 0
        for e, n in enumerate(mine):
            if n:
                out[start : start + n] = self.experts[e](gathered[start : start + n])
                self.expert_calls += 1
                start += n
        out.mul_(weights.reshape(-1, 1).index_select(0, order))
        y = torch.zeros_like(x).index_add_(0, rows, out)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None  # built with the shared expert
            y += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.ps.all_reduce(y)
