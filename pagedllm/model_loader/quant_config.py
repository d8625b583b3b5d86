"""Which quantized-checkpoint format (AWQ, GPTQ, FP8) an HF config's ``quantization_config`` names.

Kept out of :mod:`pagedllm.model_loader.zero_point`, whose base class the formats import.
"""

from __future__ import annotations

from typing import Any

from pagedllm.errors import UnsupportedModelError
from pagedllm.model_loader.awq import AWQ
from pagedllm.model_loader.fp8 import FP8
from pagedllm.model_loader.gptq import GPTQ
from pagedllm.model_loader.zero_point import ZeroPointCheckpoint


def checkpoint_scheme(hf_config: Any) -> ZeroPointCheckpoint | None:
    """How an HF checkpoint's linears are quantized (its ``quantization_config``), None if they are not; a
    method or layout pagedllm cannot run is refused with the reason."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    formats: dict[str, type[AWQ] | type[GPTQ] | type[FP8]] = {
        "awq": AWQ,
        "gptq": GPTQ,
        "compressed-tensors": FP8,
        "fbgemm_fp8": FP8,
        "fp8": FP8,
    }
    method = qc.get("quant_method")
    if method not in formats:
        raise UnsupportedModelError(
            f"checkpoint quantization {method!r} is not supported yet (AWQ, GPTQ and FP8 "
            "(compressed-tensors, fbgemm_fp8) are)"
        )
    return formats[method].from_config(qc)
