"""FP8 checkpoints: e4m3 weights with a float32 scale per tensor or per output row.

Two producers write the same thing, ``W = weight.float() * weight_scale``, for each quantized linear::

    name.weight        float8_e4m3fn [out, in]
    name.weight_scale  float32 [1] (per tensor) or [out, 1] (per row)
    name.input_scale   float32 [1], optional: a static activation scale

* ``compressed-tensors`` (llm-compressor), ``format`` "float-quantized": ``config_groups`` whose weights
  are 8-bit floats with the "tensor" or "channel" strategy;
* ``fbgemm_fp8``: per-row scales.

The weights load into :class:`pagedllm.layers.quantization.Fp8Linear` as they are (one byte each); the
activations stay float32, so an engine computes exactly what the dequantized weights compute (as vLLM's
weight-only FP8 path does on hardware without FP8 arithmetic); ``input_scale`` is not used.
Block-wise scales (``weight_block_size``, transformers' "fp8"), e5m2 weights and group strategies are
refused with the reason.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.errors import UnsupportedModelError
from pagedllm.model_loader.zero_point import ZeroPointCheckpoint


class FP8(ZeroPointCheckpoint):
    name = "FP8"
    parts = ("weight", "weight_scale")
    optional = ("input_scale",)
    method = "fp8"  # the engine's quantization for these checkpoints

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> FP8:
        method = qc.get("quant_method")
        if method == "compressed-tensors":
            fmt = qc.get("format")
            groups = qc.get("config_groups") or {}
            weights = [g.get("weights") or {} for g in groups.values()]
            bad = [
                w
                for w in weights
                if (w.get("num_bits"), w.get("type"), w.get("strategy"), bool(w.get("dynamic")))
                not in ((8, "float", "tensor", False), (8, "float", "channel", False))
            ]
            if fmt != "float-quantized" or not weights or bad:
                raise UnsupportedModelError(
                    f"compressed-tensors checkpoint with format={fmt!r} and weights {bad or weights} is not "
                    "supported: pagedllm runs its 'float-quantized' 8-bit float weights with 'tensor' or "
                    "'channel' scales"
                )
        elif method == "fp8":
            raise UnsupportedModelError(
                f"FP8 checkpoint with weight_block_size={qc.get('weight_block_size')} is not supported: pagedllm "
                "runs FP8 weights with per-tensor or per-row scales (compressed-tensors, fbgemm_fp8)"
            )
        return cls()

    def _is_quantized_part(self, name: str, part: str, t: torch.Tensor) -> bool:
        if t.dtype == torch.float8_e5m2:
            raise UnsupportedModelError(f"FP8 checkpoint: {name} is e5m2; pagedllm runs e4m3 weights")
        # a float8 weight is quantized; a float one (the head, norms, embedding) is a plain tensor
        return (part == "weight" and t.dtype == torch.float8_e4m3fn) or part in ("weight_scale", "input_scale")

    def _scale(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """One float32 scale per output row."""
        n = t["weight"].shape[0]
        s = t["weight_scale"].float().reshape(-1)
        if s.numel() not in (1, n):
            raise UnsupportedModelError(
                f"FP8 checkpoint: a weight_scale of shape {tuple(t['weight_scale'].shape)} "
                f"for {n} rows (per tensor or per row are supported)"
            )
        return s.expand(n).contiguous()

    def dequantize(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        return t["weight"].float() * self._scale(t)[:, None]

    def block(self, t: dict[str, torch.Tensor]) -> tuple[str, tuple[torch.Tensor, ...]]:
        return "fp8", (t["weight"].contiguous(), self._scale(t))
