"""LLaVA-style vision-language models (transformers' ``LlavaForConditionalGeneration``): a CLIP or SigLIP
tower, a two-layer MLP projector, and any text model of the registry, the image's features taking the places of
its ``<image>`` tokens in the prompt.

The model is the text model's class with the tower and projector added (:meth:`LlavaForConditionalGeneration.
for_text_model` builds that class once per text family): everything the engine does with a text model (the
paged KV cache, tensor and pipeline parallelism, the fused decode loop, LoRA) applies unchanged. The engine
calls :meth:`encode_images` inside the step for the images its scheduler granted, keeps the results in its
encoder cache, and hands the step's rows as ``inputs_embeds`` (the text's embeddings with the images' rows
written over their placeholders).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.distributed import ParallelState
from pagedllm.errors import UnsupportedModelError
from pagedllm.models.vision import VisionTransformer, activation


class LlavaProjector(nn.Module):
    def __init__(self, in_features: int, out_features: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(in_features, out_features, bias=bias)
        self.act = activation(act)
        self.linear_2 = nn.Linear(out_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration:
    """The LLaVA half of ``LlavaForConditionalGeneration[<text class>]``; built as the text class is, from the
    text config that :func:`~pagedllm.model_loader.hf_loader.load_hf_config` returns for a multimodal checkpoint
    (its ``multimodal_config`` is the whole one)."""

    is_multimodal = True
    _classes: ClassVar[dict[type, type]] = {}
    # the text class's
    ps: ParallelState

    @classmethod
    def for_text_model(cls, text_cls: type) -> type:
        if text_cls not in cls._classes:
            cls._classes[text_cls] = type(f"{cls.__name__}[{text_cls.__name__}]", (cls, text_cls), {})
        return cls._classes[text_cls]

    def __init__(self, cfg: Any, parallel: ParallelState | None = None):
        super().__init__(cfg, parallel)  # type: ignore[call-arg]  # the text class, next in the MRO
        mm = cfg.multimodal_config
        if getattr(mm, "quantization_config", None) is not None:
            raise UnsupportedModelError(
                "quantized vision-language checkpoints (AWQ, GPTQ, FP8) do not load yet; a float checkpoint can run "
                "with quantization='int8' or 'int4'"
            )
        self.image_token_id = int(mm.image_token_id)
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

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` → ``[B, image tokens, text hidden]``: what takes each image's placeholders."""
        assert self.vision_tower is not None and self.multi_modal_projector is not None
        states = self.vision_tower(pixel_values)
        if self.select_strategy == "default":  # CLIP's class token is not one of the image's tokens
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    # -- weights --
    _VISION = ("vision_tower.", "multi_modal_projector.")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """transformers' names of either layout (``language_model.model.*`` as saved before v5,
        ``model.language_model.*`` after): the text weights go to the text class, the tower's and the
        projector's here."""
        vision: list[tuple[str, Any]] = []

        def text(pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
            for name, tensor in pairs:
                n = name.removeprefix("model.")
                if n.startswith(self._VISION):
                    vision.append((n, tensor))
                elif n.startswith("language_model.model."):
                    yield "model." + n.removeprefix("language_model.model."), tensor
                elif n.startswith("language_model.lm_head."):
                    yield n.removeprefix("language_model."), tensor
                elif n.startswith("language_model."):
                    yield "model." + n.removeprefix("language_model."), tensor
                else:
                    yield name, tensor

        loaded: set[str] = super().load_weights(text(weights))  # type: ignore[misc]
        if self.vision_tower is None or self.multi_modal_projector is None:
            return loaded  # a later pipeline stage: no images reach it
        tower = [(n.removeprefix("vision_tower."), _whole(t)) for n, t in vision if n.startswith("vision_tower.")]
        loaded |= {f"vision_tower.{n}" for n in self.vision_tower.load_weights(tower)}
        proj = {n.removeprefix("multi_modal_projector."): _whole(t) for n, t in vision if n.startswith("multi_")}
        params = dict(self.multi_modal_projector.named_parameters())
        if set(proj) != set(params):
            raise UnsupportedModelError(f"the projector's weights are {sorted(proj)}, expected {sorted(params)}")
        for n, t in proj.items():
            if params[n].shape != t.shape:
                raise UnsupportedModelError(
                    f"projector weight {n!r} has shape {tuple(t.shape)}, expected {tuple(params[n].shape)}"
                )
            params[n].data.copy_(t)
            loaded.add(f"multi_modal_projector.{n}")
        return loaded

    def _expected_loads(self, params: dict[str, nn.Parameter]) -> list[str]:
        """The text model's (the tower and projector check their own)."""
        text = {n: p for n, p in params.items() if not n.startswith(self._VISION)}
        return super()._expected_loads(text)  # type: ignore[misc]


def image_tokens(mm: Any) -> int:
    """Rows an image's features take (a LLaVA config): a token per patch, CLIP's class token dropped by the
    "default" strategy."""
    vc = mm.vision_config
    clip = vc.model_type == "clip_vision_model"
    return (vc.image_size // vc.patch_size) ** 2 + int(clip) - int(mm.vision_feature_select_strategy == "default")


def _whole(tensor: Any) -> torch.Tensor:
    """A tensor, or a lazy checkpoint slice read whole (the tower is replicated on every rank)."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.narrow(0, 0, tensor.shape[0])
