"""Rotary position embeddings (neox / rotate-half layout, as in transformers' Llama)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm import kernels
from pagedllm.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
    """Normalise transformers v4 (`rope_theta` + `rope_scaling`) and v5 (`rope_parameters`) configs; where v5
    keeps one set per layer type (Gemma 3: `full_attention`, `sliding_attention`), ``layer_type``'s."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def _inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_ctx = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise UnsupportedModelError(
        f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(nn.Module):
    """cos and sin of each position times each frequency, computed for a step's positions when it runs: no table
    of every position the model allows (Qwen2.5's 32,768 x 64 floats were 16 MiB, Gemma 3's two 64 MiB), and the
    same bits as such a table or as transformers' (one float32 product, then torch's cos and sin)."""

    def __init__(self, head_dim: int, params: dict[str, Any]):
        super().__init__()
        # a plain attribute, not a buffer: model.to(dtype) must not round it
        self.inv_freq = _inv_freq(head_dim, params)

    def freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, D/2]: position t times frequency j, in float32 (positions below 2^24 are exact)."""
        return positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(positions.device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D/2] tables for this step's positions; computed once per step, shared by every layer."""
        freqs = self.freqs(positions).unsqueeze(1)
        return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, D] by per-token tables (rotate-half layout), in float32."""
    k = kernels.for_tensor(x)
    if (
        k is not None
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2] // 2)
        and cos.is_contiguous()
        and sin.is_contiguous()
    ):
        return k.rotary(x, cos, sin)
    dtype = x.dtype
    x1, x2 = x.float().chunk(2, dim=-1)  # .float() / .to(): no copies for float32
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)
