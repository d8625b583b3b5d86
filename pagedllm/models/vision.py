"""The vision towers of LLaVA-style models: CLIP's and SigLIP's ViT, as transformers' ``CLIPVisionModel`` and
``SiglipVisionModel`` compute them, kept only up to the layer whose output the model reads.

An image is a fixed grid of patches (the processor resizes and crops it to the tower's ``image_size``), so a
batch of images is one ``[B, patches, hidden]`` tensor and attention is plain bidirectional SDPA: no KV
cache, no paging. ``hidden_states[k]`` is transformers' numbering: 0 the embeddings (after CLIP's
pre-layernorm), k the output of layer k, negative counts from the end (-1 the last layer's output).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.errors import UnsupportedModelError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
    "relu": F.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(f"activation {name!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class VisionAttention(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // self.num_heads
        h = cfg.hidden_size
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x: torch.Tensor, b: int) -> torch.Tensor:
        """``x``: ``[b * t, hidden]``, the images' rows one after another (the linears take 2-D inputs)."""
        h = x.shape[-1]
        q, k, v = (
            p(x).view(b, -1, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        o = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(o.transpose(1, 2).reshape(-1, h))


class VisionMLP(nn.Module):
    """``fc2(act(fc1(x)))``: CLIP's, SigLIP's and Qwen2-VL's."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        eps = cfg.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.mlp = VisionMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor, b: int) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), b)
        return x + self.mlp(self.layer_norm2(x))


class VisionTransformer(nn.Module):
    """CLIP (``model_type`` "clip_vision_model": a class token, a layernorm before the layers) or SigLIP
    ("siglip_vision_model"): patch embedding, learned positions, pre-norm layers up to ``feature_layer``."""

    KINDS = ("clip_vision_model", "siglip_vision_model")

    def __init__(self, cfg: Any, feature_layers: list[int], post_layernorm: bool = False):
        """``post_layernorm``: the last layer's output goes through the tower's final layernorm (SigLIP's
        ``last_hidden_state``, which Gemma 3 reads); only with ``feature_layers`` ``[-1]``."""
        super().__init__()
        if cfg.model_type not in self.KINDS:
            raise UnsupportedModelError(
                f"vision tower {cfg.model_type!r} is not supported; supported: {', '.join(self.KINDS)}"
            )
        self.clip = cfg.model_type == "clip_vision_model"
        self.image_size, self.patch_size = cfg.image_size, cfg.patch_size
        num_layers = cfg.num_hidden_layers
        for k in feature_layers:
            if not -num_layers - 1 <= k <= num_layers:
                raise UnsupportedModelError(f"vision_feature_layer={k} is outside the tower's {num_layers} layers")
        self.read = [k % (num_layers + 1) for k in feature_layers]  # hidden_states indices, from 0
        self.num_layers = max(self.read)  # the layers whose outputs are read: the rest never run
        h = cfg.hidden_size
        num_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, h, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=not self.clip
        )
        self.class_embedding = nn.Parameter(torch.empty(h)) if self.clip else None
        self.position_embedding = nn.Embedding(num_patches + int(self.clip), h)
        self.pre_layrnorm = nn.LayerNorm(h, eps=cfg.layer_norm_eps) if self.clip else None
        self.layers = nn.ModuleList(VisionLayer(cfg) for _ in range(self.num_layers))
        if post_layernorm and self.read != [num_layers]:
            raise UnsupportedModelError("the post-layernorm applies to the last layer's output only")
        self.post_layernorm = nn.LayerNorm(h, eps=cfg.layer_norm_eps) if post_layernorm else None

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """``[B, 3, H, W]`` → each read layer's output ``[B, positions, hidden]`` (CLIP's class token first)."""
        size = tuple(pixel_values.shape[-2:])
        if size != (self.image_size, self.image_size):
            raise UnsupportedModelError(
                f"an image of {size[0]}x{size[1]} pixels reached a tower of {self.image_size}x{self.image_size}"
            )
        dtype = self.patch_embedding.weight.dtype
        x = self.patch_embedding(pixel_values.to(dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        x = x + self.position_embedding.weight
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        b, t, h = x.shape
        x = x.reshape(b * t, h)
        states = {0: x}
        for i, layer in enumerate(self.layers, 1):
            x = states[i] = layer(x, b)
        if self.post_layernorm is not None:
            states[self.num_layers] = self.post_layernorm(states[self.num_layers])
        return [states[k].view(b, t, h) for k in self.read]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """transformers' names below the tower (``vision_model.`` dropped); layers past the read one, the
        post-layernorm and SigLIP's pooling head are skipped: their outputs are never read."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("vision_model.").replace("encoder.layers.", "layers.")
            if (name.startswith("post_layernorm.") and self.post_layernorm is None) or name.startswith("head."):
                continue
            if "position_ids" in name:
                continue
            if name.startswith("layers.") and int(name.split(".")[1]) >= self.num_layers:
                continue
            name = name.replace("embeddings.", "")
            if name not in params:
                raise UnsupportedModelError(f"checkpoint has unexpected vision tower weight {name!r}")
            if params[name].shape != tensor.shape:
                raise UnsupportedModelError(
                    f"vision tower weight {name!r} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(params[name].shape)}"
                )
            params[name].data.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise UnsupportedModelError(f"checkpoint is missing vision tower weights: {missing[:8]}")
        return loaded
