"""Gemma 3 with its vision tower (transformers' ``Gemma3ForConditionalGeneration``): a SigLIP ViT (its
post-layernorm included), the image's patches average-pooled to ``mm_tokens_per_image`` tokens, Gemma's RMSNorm
and a projection into the text width, over the registry's Gemma 3 text class (its sliding-window layers as they
are).

Gemma 3's image tokens attend to each other both ways in the prompt's forward pass (transformers'
``blockwise_overlay``: causal, or within the same image; in a sliding layer, also inside the window). The runner
marks each prefill chunk's image spans in the attention metadata (``bidirectional``) and the attention backend
masks those requests accordingly; the scheduler never ends a chunk inside an image (``whole_images``), so every
key of an image is in the cache or the chunk when its queries run.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import ParallelState
from pagedllm.errors import UnsupportedModelError
from pagedllm.models.vision import VisionTransformer
from pagedllm.models.vlm import VisionLanguageModel, load_tower_and_projector


class Gemma3Projector(nn.Module):
    """transformers' ``Gemma3MultiModalProjector``: average-pool the patch grid to ``tokens`` tokens, Gemma's
    RMSNorm (``1 + weight``), then ``@ mm_input_projection_weight``."""

    def __init__(self, vision_hidden: int, text_hidden: int, patches_per_side: int, tokens: int, eps: float):
        super().__init__()
        side = round(tokens**0.5)
        if side * side != tokens or patches_per_side % side:
            raise UnsupportedModelError(
                f"mm_tokens_per_image={tokens} must be a square whose side divides the tower's {patches_per_side} "
                "patches a side"
            )
        self.patches_per_side, self.kernel, self.eps = patches_per_side, patches_per_side // side, eps
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision_hidden, text_hidden))
        self.mm_soft_emb_norm = nn.ParameterDict({"weight": nn.Parameter(torch.empty(vision_hidden))})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h = x.shape
        grid = x.transpose(1, 2).reshape(b, h, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        normed = pooled.float() * torch.rsqrt(pooled.float().pow(2).mean(-1, keepdim=True) + self.eps)
        normed = normed * (1.0 + self.mm_soft_emb_norm["weight"].float())
        return (normed.to(x.dtype) @ self.mm_input_projection_weight).to(x.dtype)


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    """The vision half of ``Gemma3ForConditionalGeneration[Gemma3ForCausalLM]``."""

    VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")
    bidirectional_images = True  # an image's tokens see each other both ways in prefill

    def __init__(self, cfg: Any, parallel: ParallelState | None = None):
        super().__init__(cfg, parallel)
        mm = cfg.multimodal_config
        self.vision_tower: VisionTransformer | None = None
        self.multi_modal_projector: Gemma3Projector | None = None
        if self.ps.is_first_stage:
            vc = mm.vision_config
            self.vision_tower = VisionTransformer(vc, [-1], post_layernorm=True)
            self.multi_modal_projector = Gemma3Projector(
                vc.hidden_size,
                cfg.hidden_size,
                vc.image_size // vc.patch_size,
                mm.mm_tokens_per_image,
                vc.layer_norm_eps,
            )

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int] | None = None) -> torch.Tensor:
        """``[B, 3, H, W]`` → ``[B, mm_tokens_per_image, text hidden]``."""
        assert self.vision_tower is not None and self.multi_modal_projector is not None
        return self.multi_modal_projector(self.vision_tower(pixel_values)[0])

    def load_vision_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        assert self.vision_tower is not None and self.multi_modal_projector is not None
        return load_tower_and_projector(self.vision_tower, self.multi_modal_projector, weights)
