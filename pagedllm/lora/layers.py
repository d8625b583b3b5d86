"""LoRA linears: ``base(x) + (x A_i) B_i`` for the adapter i of each row, many adapters in one batch.

An adapted linear keeps its base (packed float32, int4 or int8: LoRA never needs a float32 copy
of it) and ``max_loras`` slots of low-rank weights, zero-padded to ``max_lora_rank``::

    lora_a  [max_loras, parts * R, in]     the parts' A stacked (q|k|v, gate|up, or one)
    lora_b  [max_loras, out_j, R] per part  B with the adapter's scale folded in

A step's rows are grouped by slot (:class:`LoRAState`): each adapter present costs two small
matmuls per linear on its rows (SGMV-style segments), whatever the batch size; there is no loop
over tokens. Rows of the base model skip the LoRA term entirely.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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
    def __init__(self, base: nn.Module, part_sizes: list[int], max_loras: int, max_rank: int, state: LoRAState):
        super().__init__()
        self.base = base
        self.state = state
        self.part_sizes = part_sizes
        self.max_rank = max_rank
        weight = next((t for t in (*base.parameters(), *base.buffers()) if t.is_floating_point()), None)
        dtype = weight.dtype if weight is not None and weight.dtype in (torch.float32, torch.bfloat16,
                                                                           torch.float16) else torch.float32
        device = weight.device if weight is not None else torch.device("cpu")
        self.register_buffer("lora_a", torch.zeros(max_loras, len(part_sizes) * max_rank, base.in_features,
                                                   dtype=dtype, device=device), persistent=False)
        for j, size in enumerate(part_sizes):
            self.register_buffer(f"lora_b{j}", torch.zeros(max_loras, size, max_rank, dtype=dtype, device=device),
                                 persistent=False)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Load one adapter's (A, scaled B) per part into ``slot``; None leaves that part unadapted."""
        r_max = self.max_rank
        self.lora_a[slot].zero_()
        for j, part in enumerate(parts):
            b_slot = getattr(self, f"lora_b{j}")[slot]
            b_slot.zero_()
            if part is not None:
                a, b = part
                r = a.shape[0]
                self.lora_a[slot, j * r_max:j * r_max + r].copy_(a)
                b_slot[:, :r].copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        segments = self.state.segments
        if not segments:
            return y
        r = self.max_rank
        for slot, rows in segments:
            xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
            xa = xs.to(self.lora_a.dtype) @ self.lora_a[slot].T  # [t, parts * R]
            deltas = [xa[:, j * r:(j + 1) * r] @ getattr(self, f"lora_b{j}")[slot].T
                      for j in range(len(self.part_sizes))]
            delta = (deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=1)).to(y.dtype)
            if isinstance(rows, slice):
                y[rows] += delta
            else:
                y.index_add_(0, rows, delta)
        return y

    def extra_repr(self) -> str:
        return f"parts={self.part_sizes}, slots={self.lora_a.shape[0]}, max_rank={self.max_rank}"
