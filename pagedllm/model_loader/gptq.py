"""GPTQ checkpoints (AutoGPTQ / GPTQModel): 4- or 8-bit weights packed along the input dimension, with
zero points and float16 scales per group of inputs.

A quantized linear ``name`` is stored as::

    name.qweight  int32 [in * bits / 32, out]   values packed along the input dimension, lowest bits first
    name.qzeros   int32 [groups, out * bits / 32] zero points packed along the output dimension
    name.scales   fp16  [groups, out]
    name.g_idx    int32 [in]                    each input's group (i // group_size without act-order)

and ``W[n, k] = (q[k, n] - z[g, n]) * s[g, n]`` with ``g = g_idx[k]``. The original
format (``checkpoint_format`` "gptq") stores each zero point minus one; "gptq_v2" stores it
as it is. That is pagedllm's int4 layout (4 bits: scale ``s``, min ``-z * s``) or int8 layout
(8 bits: ``q - 128`` with min ``(128 - z) * s``) per group of 32: no second rounding.

Act-order checkpoints (``desc_act``: a ``g_idx`` that is not ``i // group_size``) quantized the inputs
in another order, so a group is not a contiguous run of inputs. Sorted by group, the columns are
(each group ``group_size`` of them): the blocks hold q's columns in that order, and the linear takes
its inputs in the same order (exllama's shuffle, :class:`~pagedllm.layers.quantization.InputPermuted`).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.errors import UnsupportedModelError
from pagedllm.model_loader.zero_point import ZeroPointCheckpoint


class GPTQ(ZeroPointCheckpoint):
    name = "GPTQ"
    act_order = False  # desc_act: its linears take their inputs in another order
    parts = ("qweight", "qzeros", "scales")
    optional = ("g_idx",)

    def __init__(self, bits: int, group: int | None, zero_offset: int):
        self.bits, self.group, self.zero_offset = bits, group, zero_offset

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> GPTQ:
        bits, group = qc.get("bits"), qc.get("group_size", 128)
        fmt = qc.get("checkpoint_format", "gptq")
        if bits not in (4, 8) or fmt not in ("gptq", "gptq_v2") or (group not in (-1, None) and group % 32):
            raise UnsupportedModelError(
                f"GPTQ with bits={bits}, group_size={group}, checkpoint_format={fmt!r} is not supported: "
                "pagedllm runs 4- and 8-bit GPTQ in groups of a multiple of 32 (or one group per row)"
            )
        scheme = cls(bits, None if group in (-1, None) else int(group), 1 if fmt == "gptq" else 0)
        scheme.act_order = bool(qc.get("desc_act"))
        return scheme

    def _unpack(self, packed: torch.Tensor, dim: int) -> torch.Tensor:
        """int32 words -> their ``32 / bits`` values along ``dim`` (0: rows, 1: columns), lowest bits first."""
        per = 32 // self.bits
        shifts = torch.arange(0, 32, self.bits, dtype=torch.int32)
        vals = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << self.bits) - 1)  # [R, C, per]
        if dim == 1:
            return vals.reshape(packed.shape[0], packed.shape[1] * per)
        return vals.permute(0, 2, 1).reshape(packed.shape[0] * per, packed.shape[1])

    def input_order(self, t: dict[str, torch.Tensor]) -> torch.Tensor | None:
        g_idx = t.get("g_idx")
        if g_idx is None:
            return None
        k = g_idx.shape[0]
        in_order = torch.arange(k) // (self.group or k)
        g = g_idx.long()
        if torch.equal(g, in_order):
            return None
        order = torch.argsort(g, stable=True)
        if not torch.equal(g[order], in_order):
            raise UnsupportedModelError(f"GPTQ: a g_idx whose groups are not {self.group or k} inputs each")
        return order

    def unpack(self, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        q = self._unpack(t["qweight"], 0).t()
        n, k = q.shape
        order = self.input_order(t)
        if order is not None:
            q = q[:, order]  # columns in group order
        z = self._unpack(t["qzeros"], 1).t()[:n] + self.zero_offset
        return q, z, t["scales"].float().t(), self.group or k
