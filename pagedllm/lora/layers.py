"""LoRA linears: ``base(x) + (x A_i) B_i`` for the adapter i of each row, many adapters in one batch.

An adapted linear keeps its base (packed float32, int4 or int8: LoRA never needs a float32 copy
of it) and ``max_loras`` slots of low-rank weights, zero-padded to ``max_lora_rank``::

    lora_a  [max_loras, parts * R, in]     the parts' A stacked (q|k|v, gate|up, or one)
    lora_b  [max_loras, out, parts * R]    the parts' B block-diagonal, the adapter's scale folded in

so a fused projection's LoRA term is two matmuls whatever its parts. A step's rows are grouped by
slot (:class:`LoRAState`), each adapter's rows side by side: per adapter present, each linear runs
``y[rows] += (x[rows] @ A.T) @ B.T`` (SGMV-style segments; the second matmul adds in place). There
is no loop over tokens, and rows of the base model skip the LoRA term entirely. The zero blocks of B
cost (parts - 1) x R x out multiply-adds a row: small against a dispatch per part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import cast

import torch
from torch import nn

Rows = slice | torch.Tensor  # a contiguous run of rows, or their indices


class LoRAState:
    """The current forward pass's ``[(slot, rows), ...]``, shared by one model's LoRA linears. Set for one
    pass by :meth:`active` (passed as explicitly as attention metadata; nesting is an error)."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, Rows]] | None = None

    @contextlib.contextmanager
    def active(self, segments: list[tuple[int, Rows]]) -> Iterator[None]:
        if self.segments is not None:
            raise RuntimeError("a LoRA mapping is already active: forward passes do not nest")
        self.segments = segments
        try:
            yield
        finally:
            self.segments = None


class LoRALinear(nn.Module):
    lora_a: torch.Tensor  # buffers (register_buffer), typed for mypy
    lora_b: torch.Tensor

    def __init__(self, base: nn.Module, part_sizes: list[int], max_loras: int, max_rank: int, state: LoRAState):
        super().__init__()
        self.base = base
        self.state = state
        self.part_sizes = part_sizes
        self.max_rank = max_rank
        weight = next((t for t in (*base.parameters(), *base.buffers()) if t.is_floating_point()), None)
        dtype = (
            weight.dtype
            if weight is not None and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
            else torch.float32
        )
        dtype = getattr(base, "activation_dtype", dtype)  # a layer whose stored weights are not its arithmetic's
        device = weight.device if weight is not None else torch.device("cpu")
        in_features = cast(int, base.in_features)  # every linear we wrap has it (float, packed, quantized)
        self.register_buffer(
            "lora_a",
            torch.zeros(max_loras, len(part_sizes) * max_rank, in_features, dtype=dtype, device=device),
            persistent=False,
        )
        self.register_buffer(
            "lora_b",
            torch.zeros(max_loras, sum(part_sizes), len(part_sizes) * max_rank, dtype=dtype, device=device),
            persistent=False,
        )

    @property
    def in_features(self) -> int:
        return cast(int, self.base.in_features)

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Load one adapter's (A, scaled B) per part into ``slot``; None leaves that part unadapted."""
        r_max = self.max_rank
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        offset = 0
        for j, (size, part) in enumerate(zip(self.part_sizes, parts)):
            if part is not None:
                a, b = part
                r = a.shape[0]
                self.lora_a[slot, j * r_max : j * r_max + r].copy_(a)
                self.lora_b[slot, offset : offset + size, j * r_max : j * r_max + r].copy_(b)
            offset += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        segments = self.state.segments
        if not segments:
            return y
        if x.dtype != self.lora_a.dtype:
            x = x.to(self.lora_a.dtype)
        for slot, rows in segments:
            a, b = self.lora_a[slot], self.lora_b[slot]
            if isinstance(rows, slice) and y.dtype == b.dtype:
                y[rows].addmm_(x[rows] @ a.T, b.T)
            else:
                xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
                delta = ((xs @ a.T) @ b.T).to(y.dtype)
                if isinstance(rows, slice):
                    y[rows] += delta
                else:
                    y.index_add_(0, rows, delta)
        return y

    def extra_repr(self) -> str:
        return f"parts={self.part_sizes}, slots={self.lora_a.shape[0]}, max_rank={self.max_rank}"
