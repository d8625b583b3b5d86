"""LLaVA-style vision-language models (transformers' ``LlavaForConditionalGeneration``): a CLIP or SigLIP
tower, a two-layer MLP projector, and any text model of the registry, the image's features taking the places of
its ``<image>`` tokens in the prompt. How the class is built over the text model's: :mod:`pagedllm.models.vlm`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.distributed import ParallelState
from pagedllm.errors import UnsupportedModelError
from pagedllm.models.vision import VisionTransformer, activation
from pagedllm.models.vlm import VisionLanguageModel, load_tower_and_projector


class LlavaProjector(nn.Module):
    def __init__(self, in_features: int, out_features: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(in_features, out_features, bias=bias)
        self.act = activation(act)
        self.linear_2 = nn.Linear(out_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(VisionLanguageModel):
    """The LLaVA half of ``LlavaForConditionalGeneration[<text class>]`` (see :class:`VisionLanguageModel`)."""

    VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")

    def __init__(self, cfg: Any, parallel: ParallelState | None = None):
        super().__init__(cfg, parallel)
        mm = cfg.multimodal_config
        self.select_strategy = mm.vision_feature_select_strategy
        if self.select_strategy not in ("default", "full"):
            raise UnsupportedModelError(f"vision_feature_select_strategy={self.select_strategy!r} is not supported")
        layers = mm.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        self.vision_tower: VisionTransformer | None = None
        self.multi_modal_projector: LlavaProjector | None = None
        if self.ps.is_first_stage:  # the stage that embeds the prompt
            vc = mm.vision_config
            self.vision_tower = VisionTransformer(vc, layers)
            self.multi_modal_projector = LlavaProjector(
                vc.hidden_size * len(layers),
                cfg.hidden_size,
                mm.projector_hidden_act,
                getattr(mm, "multimodal_projector_bias", True),
            )

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int] | None = None) -> torch.Tensor:
        """``[B, 3, H, W]`` → ``[B, image tokens, text hidden]``."""
        assert self.vision_tower is not None and self.multi_modal_projector is not None
        states = self.vision_tower(pixel_values)
        if self.select_strategy == "default":  # CLIP's class token is not one of the image's tokens
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    def load_vision_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        assert self.vision_tower is not None and self.multi_modal_projector is not None
        return load_tower_and_projector(self.vision_tower, self.multi_modal_projector, weights)


def image_tokens(mm: Any) -> int:
    """Rows an image's features take (a LLaVA config): a token per patch, CLIP's class token dropped by the
    "default" strategy."""
    vc = mm.vision_config
    clip = vc.model_type == "clip_vision_model"
    return (vc.image_size // vc.patch_size) ** 2 + int(clip) - int(mm.vision_feature_select_strategy == "default")
