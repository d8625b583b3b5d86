"""AWQ checkpoints (AutoAWQ's GEMM layout): 4-bit weights with a zero point and a float16 scale per group.

A quantized linear ``name`` is stored as three tensors::

    name.qweight  int32 [in, out / 8]        8 nibbles an int32, along the output dimension
    name.qzeros   int32 [in / group, out / 8] the zero points, packed the same way
    name.scales   fp16  [in / group, out]

and ``W[n, k] = (q[k, n] - z[k // group, n]) * s[k // group, n]``. Within an int32,
nibble ``i`` (bits 4i..4i+3) holds output column ``8b + AWQ_ORDER[i]``.

That is pagedllm's int4 layout (:mod:`pagedllm.layers.quantization`) with
``scale = s`` and ``min = -z * s`` for each of a group's sub-groups of 32: the
weights load into the int4 kernels without a second rounding. (The float32
model is built from the dequantized weights first, as for GGUF; the int4
blocks then replace its linears.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from pagedllm.errors import UnsupportedModelError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PARTS = ("qweight", "qzeros", "scales")


def awq_group_size(hf_config: Any) -> int | None:
    """The checkpoint's AWQ group size, None if it is not AWQ; a layout pagedllm cannot run is refused."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method == "gptq":
        return None  # pagedllm.model_loader.gptq
    if method != "awq":
        raise UnsupportedModelError(f"checkpoint quantization {method!r} is not supported yet (AWQ and GPTQ are)")
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm" or not qc.get("zero_point", True) or not group or group % 32:
        raise UnsupportedModelError(
            f"AWQ with bits={bits}, version={version!r}, zero_point={qc.get('zero_point', True)}, "
            f"group_size={group} is not supported: pagedllm runs 4-bit GEMM-layout AWQ with zero points and "
            "groups of a multiple of 32")
    return int(group)


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
    word = sum(q[..., i] << (4 * i) for i in range(8))
    return (word - ((word >> 31) << 32)).to(torch.int32).contiguous()  # two's complement: bit 31 is the sign


def int4_blocks(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AWQ linear in pagedllm's int4 layout: (packed [N, K/2] uint8, scales [N, K/32], mins [N, K/32])."""
    q = unpack(qweight).t().to(torch.uint8)  # [N, K]
    n, k = q.shape
    rep = group // 32
    s = scales.float().t().repeat_interleave(rep, dim=1)  # [N, K/32]
    z = unpack(qzeros).t().float().repeat_interleave(rep, dim=1)
    g = q.view(n, k // 32, 32)
    packed = (g[..., :16] | (g[..., 16:] << 4)).reshape(n, k // 2).contiguous()
    return packed, s.contiguous(), (-z * s).contiguous()


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """float32 [out, in]: ``(q - z) * s``."""
    q = unpack(qweight).float()  # [K, N]
    z = unpack(qzeros).float().repeat_interleave(group, dim=0)
    s = scales.float().repeat_interleave(group, dim=0)
    return ((q - z) * s).t().contiguous()


def _modules(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each AWQ linear's three gathered: ``(name, tensor)`` for plain ones,
    ``(module, {part: tensor})`` for quantized ones."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        module, _, part = name.rpartition(".")
        if part not in _PARTS:
            yield name, t
            continue
        got = pending.setdefault(module, {})
        got[part] = t
        if len(got) == 3:
            yield module, pending.pop(module)
    if pending:
        raise UnsupportedModelError(f"AWQ checkpoint: {sorted(pending)[0]} lacks one of {list(_PARTS)}")


def iter_awq_weights(weights: Iterator[tuple[str, torch.Tensor]], group: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint as float32 weights by transformers' names (AWQ linears dequantized)."""
    for name, value in _modules(weights):
        if isinstance(value, dict):
            yield f"{name}.weight", dequantize(value["qweight"], value["qzeros"], value["scales"], group)
        elif not name.endswith("rotary_emb.inv_freq"):
            yield name, value.to(torch.float32)


def awq_blocks(weights: Iterator[tuple[str, torch.Tensor]], group: int) -> dict[str, tuple[str, tuple]]:
    """Every AWQ linear as ``("int4", (packed, scales, mins))``, by its weight's transformers name."""
    return {f"{name}.weight": ("int4", int4_blocks(value["qweight"], value["qzeros"], value["scales"], group))
            for name, value in _modules(weights) if isinstance(value, dict)}


class AWQ:
    """The loader's view of an AWQ checkpoint (the same interface as :class:`~pagedllm.model_loader.gptq.GPTQ`)."""

    method = "int4"  # the engine's quantization for it

    def __init__(self, group: int):
        self.group = group

    def iter_float(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_awq_weights(weights, self.group)

    def blocks(self, weights: Iterator[tuple[str, torch.Tensor]]) -> dict[str, tuple[str, tuple]]:
        return awq_blocks(weights, self.group)


def checkpoint_scheme(hf_config: Any) -> "AWQ | GPTQ | None":
    """How an HF checkpoint's linears are quantized (its ``quantization_config``), None if they are not."""
    from pagedllm.model_loader.gptq import GPTQ

    group = awq_group_size(hf_config)
    return AWQ(group) if group is not None else GPTQ.from_config(hf_config)
