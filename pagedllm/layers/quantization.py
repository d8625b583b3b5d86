"""Quantization for CPU inference: ``quantization="int8"``, ``"int4"``, ``"fp8"`` (weight-only), ``"w4a8"``
and ``"w4a16"``.

Decode on a CPU is bound by the bytes of weight each token reads, so storing
weights in 8 or 4 bits is what makes single-stream decode fast. Activations stay
float32: a quantized model computes the same function as the float32 model
holding its dequantized weights, up to summation order.

* ``int8``: int8 weights in groups of 32 along the input dimension, with a
  scale and a min per group (``w = q * scale + min``, q in -128..127; 10 bits
  a weight). A per-output-channel scale measured 3/8 identical greedy
  sequences on SmolLM2; groups keep more, and with a min they hold GGUF's Q8_0
  (min 0) and widened Q4_0 / Q4_1 blocks exactly.
* ``int4``: 4-bit weights in groups of 32 (``w = q * scale + min``, q in
  0..15), the layout of GGUF's Q4_1 (5 bits a weight).

A GGUF's Q8_0 / Q4_0 / Q4_1 blocks load into these without a second rounding,
so a GGUF model quantized this way holds exactly the weights the float32 path
dequantizes (Q8_0 stays 8-bit under ``int4``: it is rounded to 4 bits there).

Small batches (decode) run kernels of ours (:mod:`pagedllm.kernels`) that widen
the weights in registers. Larger batches unpack the weight to float32 once per
call, into a buffer kept across calls, and use oneDNN's GEMM (MKL's where
oneDNN is missing): the unpacking is a small part of that work.
PyTorch's own CPU int8/int4 weight kernels (``_weight_int8pack_mm``,
``_weight_int4pack_mm_for_cpu``) measured 10-35x slower than float32 on this
AVX2 machine, and fbgemm's dynamically quantized int8 linear rounds activations
per tensor to 7 bits, which took SmolLM2's perplexity from 38.7 to 120.

* ``w4a8``: ``int4`` weights with int8 activations, llama.cpp's arithmetic. Each
  row of a linear's input is rounded per group of 32 to int8 (GGUF's Q8_0: a
  scale of max|x| / 127), and the products of 4-bit weights and 8-bit
  activations are summed in integers (AVX2's maddubs or VNNI's vpdpbusd: 32 in
  one or two instructions). Up to 3 rows a kernel streams the weights; more rows
  (prefill, batched decode) go through an integer GEMM on repacked weight panels
  (``quant_matmul.c``), about twice oneDNN's float32 GEMM on the same shapes.
  Not the float32 function any more (greedy tokens drift from float32's: see
  ``pagedllm bench accuracy``), but the same one at every batch size.
* ``w4a16``: the same with each group rounded to int16 (scale max|x| / 32512),
  multiplied as two int8 digits: twice the integer products of ``w4a8``, and the
  float32 function to about 1e-5, so float32's greedy tokens.

Where the CPU has no VNNI, int8 weights (the head) leave batches of more than
``SMALL_BATCH_A8`` rows to the float32 GEMM on the rounded activations (maddubs
would overflow its int16 pair sums there): the same function.

* ``fp8``: e4m3 weights with a float32 scale per output row (an FP8 checkpoint's own, or rounded here
  from float weights: ``max|w| / 448`` a row), activations float32; each call widens the weight into
  the shared buffer and runs the float32 GEMM. One byte a weight, and the float32 function of
  those weights. The head stays as the checkpoint has it.

The logits head is int8 in the int modes (with the mode's integer activations under ``w4a8`` / ``w4a16``)
(llama.cpp also keeps its output layer at 6-8 bits). Embedding lookups stay in the model dtype: they read
one row a token, except that a tied head holding the embedding's own values (a GGUF's blocks) serves the lookups too.
Every int-quantized input size must be a multiple of 32.
"""

from __future__ import annotations

from typing import Any, TypeGuard, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.errors import InvalidParameterError
from pagedllm.layers.linear import SMALL_BATCH, onednn_available, onednn_linear
from pagedllm.layers.linear import float_bias as _bias
from pagedllm.layers.linear import quantized_scratch as _scratch
from pagedllm.layers.vocab_parallel import VocabParallelEmbedding

GROUP = 32
SMALL_BATCH_A8 = 16  # the same for the integer-activation kernels where they have no GEMM for the weights
ACTIVATION_BITS = {"w4a8": 8, "w4a16": 16}  # the modes with integer activations
# A GGUF's blocks as stored, by mode: the activation bits of their integer kernels (None: float32 activations)
GGUF_MODES: dict[str, int | None] = {"gguf": 8, "gguf-exact": None}
# the GGUF types "gguf" runs from the file's own bytes (pagedllm/kernels/gguf_blocks.c: 4.5, 6.56, 8.5, 5.5 and 5.5
# bits a weight, integer sums per block; Q4_0 and IQ4_NL 4.5, Q4_1 5, Q5_1 6, IQ4_XS 4.25, Q3_K 3.44, Q2_K 2.63): Q4_K
# and Q6_K everywhere, Q8_0, Q5_0, Q5_K, Q4_0, Q4_1, Q5_1, Q3_K, Q2_K and the 4-bit i-quants where the CPU runs them in
# panels of 16 rows (gguf_linear_types); the other types, and every type under "gguf-exact" (whose float32-activation
# kernels on our layouts are faster), are converted at load into the int4 / int8 layouts, exactly
NATIVE_GGUF_TYPES = ("Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q5_K", "Q4_0", "Q4_1", "Q5_1", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K")
# the float types whose matrices both GGUF modes keep as the file stores them, 2 bytes a weight (HalfLinear);
# BF16P: a BF16 one repacked for bfloat16 dot products ("gguf" on AVX512_BF16)
HALF_GGUF_TYPES = ("F16", "BF16", "BF16P")


def gguf_linear_types() -> tuple[str, ...]:
    """The types of NATIVE_GGUF_TYPES that "gguf" takes as the file stores them on this CPU: Q8_0, Q5_0, Q5_K, Q4_0,
    Q4_1, Q5_1, Q3_K, Q2_K and the 4-bit i-quants only where their panel kernels are built (AVX2 and AVX-512 VNNI; all
    but Q8_0 and Q5_0 have no other), and there they beat the int8 groups they were converted to (1.25 bytes a weight
    against 0.69 and 1.06): on AVX-512 VNNI, Qwen2.5-Coder-0.5B's Q5_0 projections 1.4-1.6x at one row, its Q8_0 head
    (152k rows) 1.2x at one row and 2.9x at five. Elsewhere the int8 groups' kernels are kept."""
    from pagedllm import kernels

    found = kernels.try_load()
    return NATIVE_GGUF_TYPES if found is not None and found.gguf.has_panels else NATIVE_GGUF_TYPES[:2]


Block = tuple[str, tuple[torch.Tensor, ...]]  # a checkpoint's own quantized weights: (kind, its tensors)


def check_quantization_supported(method: str, device: torch.device) -> None:
    """Can this device run ``method`` (a value EngineConfig has already validated)?"""
    if device.type != "cpu":
        raise InvalidParameterError(
            f"quantization={method!r} runs on pagedllm's CPU kernels; it is not supported on device {device.type!r}",
            "quantization",
        )
    from pagedllm import kernels

    try:
        kernels.load()
    except kernels.KernelBuildError as e:
        raise InvalidParameterError(f"quantization={method!r} needs pagedllm's C kernels: {e}", "quantization") from e


class _QuantLinear(nn.Module):
    """Shared by the int8 and int4 linears: q [N, K * bits / 8], scales and mins [N, K/32], optional bias.
    int8 weights may carry a scale and a min per 16 instead (scales [N, K/16], GGUF's Q6_K / Q3_K / Q2_K; mins
    [N, K/16], or per 32, then kept per 16), with float32 activations.
    Mins that are all 0 (GGUF's Q8_0 / Q5_0 / Q6_K) are not kept (``mins`` None): a bit less a weight."""

    bits: int
    # buffers (register_buffer), typed here, as nn.Module's __getattr__ does not know them
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        bias: torch.Tensor | None,
        activation_bits: int | None = None,
    ):
        super().__init__()
        from pagedllm import kernels

        self._kernels = kernels.load()
        self.out_features, self.in_features = qweight.shape[0], qweight.shape[1] * 8 // self.bits
        if self.in_features % GROUP:
            raise ValueError(f"quantized linears need in_features divisible by {GROUP}, got {self.in_features}")
        self.register_buffer("qweight", qweight.contiguous(), persistent=False)
        self.register_buffer("scales", scales.float().contiguous(), persistent=False)
        self.register_buffer("mins", mins.float().contiguous() if mins.any() else None, persistent=False)
        self.bias = _bias(bias)
        if activation_bits not in (None, 8, 16):
            raise ValueError(f"integer activations are 8 or 16 bits, not {activation_bits}")
        self.activation_bits = activation_bits  # None: float32 activations
        self.scales_per_group = scales.shape[1] * GROUP // self.in_features
        g16 = self.scales_per_group == 2
        if g16 and (self.bits != 8 or activation_bits):
            raise ValueError("a scale per 16 weights is an int8 layout with float32 activations")
        if g16 and self.mins is not None:  # a min per 16 too, as the kernels read them (Q2_K's own; else repeated)
            from pagedllm.kernels.ops import mins_per_16

            self.mins = mins_per_16(self.mins, self.in_features)
        self._matmul = getattr(
            self._kernels,
            f"int{self.bits}_matmul{f'_a{activation_bits}' if activation_bits else ''}{'_g16' if g16 else ''}",
        )
        self._dequantize = getattr(self._kernels, f"int{self.bits}_dequantize{'_g16' if g16 else ''}")
        self._small_batch: float = SMALL_BATCH  # a row count, or inf
        if activation_bits:  # the integer kernels take every batch where they have a GEMM for these weights
            self._small_batch = float("inf") if self.bits in self._kernels.a8_gemm_bits else SMALL_BATCH_A8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.dtype != torch.float32:
            return self.forward(x.reshape(-1, self.in_features).float()).view(*x.shape[:-1], -1).to(x.dtype)
        x = x.contiguous()
        if x.shape[0] > self._small_batch:  # unpack into a buffer kept warm across calls, then a float32 GEMM
            if self.activation_bits:  # on the activations the integer kernel sees: the same function
                x = self._kernels.round_activations(x, self.activation_bits)
            w = self._dequantize(self.qweight, self.scales, self.mins, _scratch(self.out_features * self.in_features))
            return (onednn_linear if onednn_available() else F.linear)(x, w, self.bias)
        y = self._matmul(x, self.qweight, self.scales, self.mins)
        return y if self.bias is None else y.add_(self.bias)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._dequantize(self.qweight, self.scales, self.mins), self.bias

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W, float32 [len(ids), K]: an embedding lookup in the same table."""
        mins = None if self.mins is None else self.mins.index_select(0, ids)
        return self._dequantize(self.qweight.index_select(0, ids), self.scales.index_select(0, ids), mins)

    def extra_repr(self) -> str:
        act = f", int{self.activation_bits} activations" if self.activation_bits else ""
        group = GROUP // self.scales_per_group
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits} group {group}{act}"


class Int8Linear(_QuantLinear):
    """y = x @ W.T + b with W int8 in groups of 32: ``W[n, k] = q[n, k] * scale[n, g] + min[n, g]``, g = k // 32."""

    bits = 8

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, activation_bits: int | None = None
    ) -> Int8Linear:
        return cls(*quantize_int8(weight), bias, activation_bits)


class Int4Linear(_QuantLinear):
    """y = x @ W.T + b with W in 4-bit groups of 32: ``W[n, g*32 + j] = q * scale[n, g] + min[n, g]``.

    ``qweight`` is [N, K/2] uint8: byte j of a group holds element j in its low
    nibble and element j + 16 in its high nibble (GGUF's Q4 packing).
    """

    bits = 4

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, activation_bits: int | None = None
    ) -> Int4Linear:
        return cls(*quantize_int4(weight), bias, activation_bits)


def _round_groups(weight: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round each group of 32 to ``levels + 1`` evenly spaced values over its range: (q [N, G, 32] in
    0..levels as float, scales, lows [N, G])."""
    w = weight.detach().float()
    n, k = w.shape
    g = w.view(n, k // GROUP, GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scales = (hi - lo) / levels
    inv = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    return torch.clamp(torch.round((g - lo[..., None]) * inv[..., None]), 0, levels), scales, lo


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest int8 groups of 32 over each group's range: (int8 [N, K], scales, mins [N, K/32])."""
    q, scales, lo = _round_groups(weight, 255)
    return (q - 128).to(torch.int8).reshape(weight.shape).contiguous(), scales, lo + 128 * scales


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit groups of 32 (GGUF Q4_1's grid): (packed [N, K/2] uint8, scales, mins)."""
    q, scales, lo = _round_groups(weight, 15)
    return pack_int4(q.reshape(weight.shape)), scales, lo


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> Int4Linear's packed [N, K/2] uint8 (element j and j + 16 of a group share a byte)."""
    g = q.to(torch.uint8).reshape(q.shape[0], -1, GROUP)
    return (g[..., : GROUP // 2] | (g[..., GROUP // 2 :] << 4)).reshape(q.shape[0], -1).contiguous()


def zero_point_blocks(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int, bits: int
) -> tuple[str, tuple[torch.Tensor, ...]]:
    """Weights ``W[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g]`` (g = k // group, a multiple of 32) in
    the int4 (bits 4, q 0..15) or int8 (bits 8, q 0..255) layout, holding exactly the same values:
    ``("int4" | "int8", (q, scales, mins))`` per group of 32."""
    rep = group // GROUP
    s = scales.float().repeat_interleave(rep, 1).contiguous()
    z = zeros.float().repeat_interleave(rep, 1)
    if bits == 4:
        return "int4", (pack_int4(q), s, (-z * s).contiguous())
    return "int8", ((q.to(torch.int32) - 128).to(torch.int8).contiguous(), s, ((128 - z) * s).contiguous())


def common_layout(parts: list[Block]) -> list[Block]:
    """Blocks of one fused linear's shards in one layout holding exactly their values: int4 becomes int8 where
    any shard is int8, and a scale (a min) per 32 becomes two equal ones per 16 where any shard has a scale (a
    min) per 16 (a GGUF's Q4_K_M mixes Q4_K and Q6_K within q/k/v; Q2_K has its mins per 16). Blocks with an
    input order (act-order) stay as they are."""
    if all(kind in NATIVE_GGUF_TYPES for kind, _ in parts):
        return parts  # as the file stores them: one GGUFLinear a shard (see stacked_gguf)
    one_kind = len({kind for kind, _ in parts}) == 1
    if any(len(t) != 3 for _, t in parts) or (
        one_kind and len({(t[1].shape[1:], t[2].shape[1:]) for _, t in parts}) == 1
    ):
        return parts
    int8 = [widen_int4(*t) if kind == "int4" else t for kind, t in parts]
    per16 = max(t[1].shape[1] * GROUP // t[0].shape[1] for t in int8)  # 2 where any has a scale per 16
    mins16 = max(t[2].shape[1] * GROUP // t[0].shape[1] for t in int8)  # 2 where any has a min per 16 (Q2_K)
    out: list[Block] = []
    for q, scales, mins in int8:
        rep = per16 * q.shape[1] // (scales.shape[1] * GROUP)
        mrep = mins16 * q.shape[1] // (mins.shape[1] * GROUP)
        scales = scales.repeat_interleave(rep, 1) if rep > 1 else scales
        out.append(("int8", (q, scales, mins.repeat_interleave(mrep, 1) if mrep > 1 else mins)))
    return out


def widen_int4(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 blocks as int8 ones holding the same values: each nibble becomes a byte."""
    n, half = qweight.shape
    packed = qweight.view(n, half // 16, 16)
    q = torch.cat([packed & 15, packed >> 4], dim=-1).view(torch.int8)  # 0..15 as int8
    return q.reshape(n, half * 2).contiguous(), scales, mins


class Fp8Linear(nn.Module):
    """y = x @ W.T + b with ``W[n, k] = weight[n, k] * scale[n]``, ``weight`` float8_e4m3fn."""

    weight: torch.Tensor  # buffers (register_buffer), typed for mypy
    scale: torch.Tensor

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.contiguous(), persistent=False)
        self.register_buffer("scale", scale.float().reshape(-1, 1).contiguous(), persistent=False)
        self.bias = _bias(bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Fp8Linear:
        w = weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return cls((w / scale).to(torch.float8_e4m3fn), scale, bias)

    def _widened(self, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(self.weight).mul_(self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.dtype != torch.float32:
            return self.forward(x.reshape(-1, self.in_features).float()).view(*x.shape[:-1], -1).to(x.dtype)
        w = self._widened(
            _scratch(self.out_features * self.in_features)[: self.out_features * self.in_features].view(
                self.out_features, self.in_features
            )
        )
        return (onednn_linear if onednn_available() else F.linear)(x.contiguous(), w, self.bias)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._widened(torch.empty(self.out_features, self.in_features)), self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, a scale per row"


def quantize_fp8(model: nn.Module, blocks: dict[str, Block] | None, checkpoint: bool, from_float: bool = True) -> None:
    """``fp8``: each projection with an FP8 block takes it as it is; without a checkpoint's blocks (a float
    model quantized here), each is rounded per row. The logits head stays as it is. ``from_float`` False:
    only the blocks are taken (before the float weights load, which then skip those projections' weights)."""
    blocks = blocks or {}
    for module, child_name, child, full in _projections(model):
        block = blocks.get(full)
        if _takes_block(block, child.weight) and block[0] == "fp8":
            weight, scale = block[1]
            setattr(module, child_name, Fp8Linear(weight, scale, child.bias))
        elif from_float and not checkpoint:
            setattr(module, child_name, Fp8Linear.from_float(child.weight, child.bias))


def _projections(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear, str]]:
    """Every float ``nn.Linear`` but the logits head, as ``(parent, its name there, the linear, full name)``."""
    return [
        (module, child_name, child, f"{name}.{child_name}" if name else child_name)
        for name, module in model.named_modules()
        for child_name, child in module.named_children()
        if isinstance(child, nn.Linear) and child_name != "lm_head"
    ]


def quantize_model(
    model: nn.Module, method: str, blocks: dict[str, Block] | None = None, from_float: bool = True
) -> None:
    """Replace the model's projections (and its logits head) by quantized linears, in place.

    ``blocks`` maps a module name (``layers.0.self_attn.qkv_proj``, ``lm_head``) to
    ``(kind, (q, scales, mins))`` taken as they are from a GGUF file, kind "int4"
    or "int8". They are used instead of rounding the float weights again: as they
    are, or int4 widened to int8; only int8 blocks under ``int4`` are rounded.
    The head is int8 in both modes. ``from_float`` False: only the layers that take
    their block are replaced, before the float weights load, which then skip their
    weights (a bias still loads, into the new layer); a second call with True does
    the rest.

    The GGUF modes (:data:`GGUF_MODES`) take every block as it is stored, int4 or int8, head included, and
    round nothing: a linear the file holds in float stays float.
    """
    blocks = blocks or {}
    if method in GGUF_MODES:
        _take_stored_blocks(model, blocks, GGUF_MODES[method])
        return
    abits = ACTIVATION_BITS.get(method)  # None: float32 activations
    bits = "int8" if method == "int8" else "int4"
    for module, child_name, child, full in _projections(model):
        if from_float or _uses_block(blocks.get(full), child.weight, bits, abits):
            setattr(module, child_name, _quantized(child.weight, child.bias, bits, blocks.get(full), full, abits))
    if model.lm_head is not None and not isinstance(model.lm_head, nn.Linear):
        return  # taken from its block already
    tied = model.lm_head is None
    head = cast(torch.Tensor, cast(nn.Module, model.embed_tokens if tied else model.lm_head).weight)
    block = blocks.get("lm_head")
    if not (from_float or _uses_block(block, head, "int8", abits)):
        return
    model.lm_head = _quantized(head, None, "int8", block, "lm_head", abits)
    ps = getattr(model, "ps", None)
    if (
        tied
        and _uses_block(block, head, "int8", abits)
        and type(model.lm_head) is Int8Linear
        and (ps is None or ps.world_size == 1)
    ):
        # the head holds the embedding's own values: look rows up there, and drop the float32 table
        model.embed_tokens = QuantizedEmbedding(model.lm_head)


def _take_stored_blocks(model: nn.Module, blocks: dict[str, Block], activation_bits: int | None) -> None:
    """The GGUF modes: each projection and the head with a block becomes that block's linear (int4 or int8 as
    stored; ``activation_bits`` where its kernel takes them, float32 activations for a scale per 16, Q6_K's);
    the embedding reads its rows from its own block (or from the tied head's)."""

    def stored(block: Block, bias: torch.Tensor | None, lookup_only: bool = False) -> nn.Module:
        if block[0] in HALF_GGUF_TYPES:
            from pagedllm.layers.gguf_linear import HalfLinear

            packed = block[0] == "BF16P"  # (an embedding's own table only looked up: left as the file stores it)
            one_kernel = activation_bits is not None and (packed or not lookup_only)
            return HalfLinear(block[1][0], bias, one_kernel=one_kernel, packed=packed)
        if block[0].startswith("gguf:"):
            from pagedllm.layers.gguf_linear import stacked_gguf

            # a table only looked up stays as the file stores it (its rows read from the mapping as asked)
            return stacked_gguf(block[0].removeprefix("gguf:").split(","), block[1], bias, activation_bits, lookup_only)
        kind, (q, scales, mins) = block[0], block[1][:3]
        g16 = scales.shape[1] * GROUP > q.shape[1] * (2 if kind == "int4" else 1)  # more scales than groups
        abits = None if g16 else activation_bits
        return (Int4Linear if kind == "int4" else Int8Linear)(q, scales, mins, bias, abits)

    for module, child_name, child, full in _projections(model):
        block = blocks.get(full)
        if _takes_block(block, child.weight):
            setattr(module, child_name, stored(block, child.bias))
    block = blocks.get("lm_head")  # a tied model's is the embedding's block
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    taken = model.lm_head is not None and not isinstance(model.lm_head, nn.Linear)
    if isinstance(head, nn.Module) and not taken and _takes_block(block, cast(torch.Tensor, head.weight)):
        model.lm_head = stored(block, None)
    ps = getattr(model, "ps", None)
    embedding = model.embed_tokens
    if not isinstance(embedding, VocabParallelEmbedding) or not (ps is None or ps.world_size == 1):
        return  # a quantized table already, none on this stage, or a vocabulary shard (kept float)
    own = blocks.get("embed_tokens")
    if getattr(model, "tie_word_embeddings", False) and taken_head(model.lm_head):
        model.embed_tokens = QuantizedEmbedding(model.lm_head)  # one table for both
    elif _takes_block(own, embedding.weight):
        table = stored(own, None, lookup_only=True)
        if taken_head(table):
            model.embed_tokens = QuantizedEmbedding(table)
            if getattr(table, "lookup_only", False):  # the file's mapping stays for it: what loading left there goes
                from pagedllm.model_loader.mappings import release_whole_mapping

                release_whole_mapping(cast(torch.Tensor, table.raw))


def taken_head(layer: object) -> bool:
    """Can :class:`QuantizedEmbedding` read its rows from ``layer``?"""
    from pagedllm.layers.gguf_linear import GGUFLinear, HalfLinear

    return isinstance(layer, _QuantLinear | GGUFLinear | HalfLinear)


class QuantizedEmbedding(nn.Module):
    """Embedding rows read from a quantized table's groups (``q * scale + min``: the values the float table
    would hold), a tied head's or the embedding's own block: only the rows looked up are widened, so the
    vocabulary is kept once, in its 4 or 8 bits, never as a float32 table."""

    def __init__(self, table: Any):
        super().__init__()
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        # in a list, not a submodule: the table is the head's (or only this one's), so its tensors are held once
        # and nothing for .to() moves them twice
        self.table: list[Any] = [table]
        self.kind = f"int{table.bits}" if isinstance(table, _QuantLinear) else str(table)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table[0].rows(input_ids.reshape(-1)).view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of {self.kind}"


def _takes_block(block: Block | None, weight: torch.Tensor) -> TypeGuard[Block]:
    """Is ``block`` (a checkpoint's own groups) used as it is for ``weight``? Not on a padded vocabulary shard."""
    if block is None:
        return False
    rows = sum(t.shape[0] for t in block[1]) if block[0].startswith("gguf:") else block[1][0].shape[0]
    return rows == weight.shape[0]


def _uses_block(block: Block | None, weight: torch.Tensor, bits: str, activation_bits: int | None) -> TypeGuard[Block]:
    """Does :func:`_quantized` build the layer from ``block`` (no float weights needed)? int8 blocks with a scale
    per 16 run with float32 activations only."""
    if not _takes_block(block, weight) or not (block[0] == bits or (block[0], bits) == ("int4", "int8")):
        return False
    return not (activation_bits and block[1][1].shape[1] * GROUP > weight.shape[1])


def _quantized(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    bits: str,
    block: Block | None,
    name: str,
    activation_bits: int | None,
) -> nn.Module:
    """``bits`` "int8" or "int4": the layer's weight format."""
    if weight.shape[1] % GROUP:
        raise InvalidParameterError(
            f"quantization needs input sizes divisible by {GROUP}; {name} has {weight.shape[1]}", "quantization"
        )
    cls = Int8Linear if bits == "int8" else Int4Linear
    if _uses_block(block, weight, bits, activation_bits):
        kind, tensors = block
        order = tensors[3] if len(tensors) == 4 else None  # an act-order linear's input order, a row a shard
        q, scales, mins = tensors[:3]
        layer = (
            cls(q, scales, mins, bias, activation_bits)
            if kind == bits
            else Int8Linear(*widen_int4(q, scales, mins), bias, activation_bits)
        )
        if order is None:
            return layer
        if not (order == order[0]).all():
            raise InvalidParameterError(
                f"{name}: its act-order shards take their inputs in different orders, "
                "so they cannot run as one fused linear",
                "quantization",
            )
        return InputPermuted(layer, order[0])
    return cls.from_float(weight, bias, activation_bits)


class InputPermuted(nn.Module):
    """An act-order linear (GPTQ ``desc_act``): its groups run over the inputs in ``order``, so each input
    row is gathered into that order first (exllama's shuffle); ``inner`` holds the columns in that order."""

    order: torch.Tensor  # a buffer (register_buffer), typed for mypy

    def __init__(self, inner: nn.Module, order: torch.Tensor):
        super().__init__()
        self.bias = inner.bias  # the inner layer's own parameter, under the float layer's name, for loading
        self.inner = inner
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self.register_buffer("order", order.long().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.order))


def dequantize_model(model: nn.Module) -> None:
    """Replace every quantized linear by a float32 ``nn.Linear`` holding its dequantized weights, in place.

    The result computes with exactly the weights the quantized model holds, through
    PyTorch's float32 GEMM: the reference the quantized kernels are tested against.
    """
    from pagedllm.layers.gguf_linear import GGUFLinear, HalfLinear, StackedLinear

    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, (Int8Linear, Int4Linear, Fp8Linear, GGUFLinear, StackedLinear, HalfLinear)):
                w, b = child.dequantized()
                lin = nn.Linear(child.in_features, child.out_features, bias=b is not None)
                lin.weight.data.copy_(w)
                if b is not None:
                    lin.bias.data.copy_(b)
                setattr(module, child_name, lin)
