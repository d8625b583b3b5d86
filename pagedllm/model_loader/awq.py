"""AWQ checkpoints (AutoAWQ's GEMM layout): 4-bit weights with a zero point and a float16 scale per group.

A quantized linear ``name`` is stored as three tensors::

    name.qweight  int32 [in, out / 8]        8 nibbles an int32, along the output dimension
    name.qzeros   int32 [in / group, out / 8] the zero points, packed the same way
    name.scales   fp16  [in / group, out]

and ``W[n, k] = (q[k, n] - z[k // group, n]) * s[k // group, n]``. Within an int32,
nibble ``i`` (bits 4i..4i+3) holds output column ``8b + AWQ_ORDER[i]``.

That is pagedllm's int4 layout (:mod:`pagedllm.layers.quantization`) with
``scale = s`` and ``min = -z * s`` for each of a group's sub-groups of 32: the
weights load into the int4 kernels without a second rounding (see
:mod:`pagedllm.model_loader.zero_point`).
"""

from __future__ import annotations

from typing import Any, cast

import torch

from pagedllm.errors import UnsupportedModelError
from pagedllm.model_loader.zero_point import ZeroPointCheckpoint

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] -> the [R, C] nibbles in column order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nib = (packed.to(torch.int32)[..., None] >> shifts) & 0xF  # [R, C/8, 8]: nibble i
    out = torch.empty_like(nib)
    out[..., list(AWQ_ORDER)] = nib
    return out.reshape(packed.shape[0], -1)


def pack(q: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`unpack` (for writing test checkpoints): [R, C] nibbles -> int32 [R, C/8]."""
    q = q.to(torch.int64).reshape(q.shape[0], -1, 8)[..., list(AWQ_ORDER)]
    word = cast(torch.Tensor, sum(q[..., i] << (4 * i) for i in range(8)))  # sum() types its 0 start in
    return (word - ((word >> 31) << 32)).to(torch.int32).contiguous()  # two's complement: bit 31 is the sign


class AWQ(ZeroPointCheckpoint):
    name = "AWQ"
    parts = ("qweight", "qzeros", "scales")
    bits = 4

    def __init__(self, group: int):
        self.group = group

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> AWQ:
        bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or not qc.get("zero_point", True) or not group or group % 32:
            raise UnsupportedModelError(
                f"AWQ with bits={bits}, version={version!r}, zero_point={qc.get('zero_point', True)}, "
                f"group_size={group} is not supported: pagedllm runs 4-bit GEMM-layout AWQ with zero points and "
                "groups of a multiple of 32"
            )
        return cls(int(group))

    def unpack(self, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        return unpack(t["qweight"]).t(), unpack(t["qzeros"]).t(), t["scales"].float().t(), self.group
