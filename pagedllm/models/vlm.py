"""What every vision-language family shares: the class built over a text model's, and the weight split between
the text model and the vision half.

A family's class (LLaVA's, Qwen2-VL's) is the text model's class with a vision half added
(:meth:`VisionLanguageModel.for_text_model` builds that class once per text family): everything the engine does
with a text model (the paged KV cache, tensor and pipeline parallelism, the fused decode loop, LoRA) applies
unchanged. The engine calls :meth:`encode_images` inside the step for the images its scheduler granted, keeps the
results in its encoder cache, and hands the step's rows as ``inputs_embeds`` (the text's embeddings with the
images' rows written over their placeholders).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from pagedllm.distributed import ParallelState
from pagedllm.errors import UnsupportedModelError


class VisionLanguageModel:
    """The vision half of ``<Family>[<text class>]``; built as the text class is, from the text config that
    :func:`~pagedllm.model_loader.hf_loader.load_hf_config` returns for a multimodal checkpoint (its
    ``multimodal_config`` is the whole one)."""

    is_multimodal = True
    uses_mrope = False  # M-RoPE (Qwen2-VL): the runner gives [3, T] positions where a step holds image rows
    # checkpoint name prefixes of the vision half (after ``model.``)
    VISION_PREFIXES: ClassVar[tuple[str, ...]] = ()
    _classes: ClassVar[dict[tuple[type, type], type]] = {}
    # the text class's
    ps: ParallelState

    @classmethod
    def for_text_model(cls, text_cls: type) -> type:
        key = (cls, text_cls)
        if key not in VisionLanguageModel._classes:
            VisionLanguageModel._classes[key] = type(f"{cls.__name__}[{text_cls.__name__}]", (cls, text_cls), {})
        return VisionLanguageModel._classes[key]

    def __init__(self, cfg: Any, parallel: ParallelState | None = None):
        super().__init__(cfg, parallel)  # type: ignore[call-arg]  # the text class, next in the MRO
        mm = cfg.multimodal_config
        if getattr(mm, "quantization_config", None) is not None:
            raise UnsupportedModelError(
                "quantized vision-language checkpoints (AWQ, GPTQ, FP8) do not load yet; a float checkpoint can run "
                "with quantization='int8' or 'int4'"
            )
        self.image_token_id = int(mm.image_token_id)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int] | None = None) -> torch.Tensor:
        """``[B, ...]`` pixels of B images of one shape (and, for a dynamic-resolution family, one grid) →
        ``[B, image tokens, text hidden]``: what takes each image's placeholders."""
        raise NotImplementedError

    def load_vision_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        """The vision half's weights (names below ``model.``), whole tensors; returns the names loaded."""
        raise NotImplementedError

    # -- weights --
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """transformers' names of either layout (``language_model.model.*`` as saved before v5,
        ``model.language_model.*`` after): the text weights go to the text class, the vision half's here."""
        vision: list[tuple[str, Any]] = []

        def text(pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
            for name, tensor in pairs:
                n = name.removeprefix("model.")
                if n.startswith(self.VISION_PREFIXES):
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
        if not self.ps.is_first_stage:
            return loaded  # a later pipeline stage: no images reach it
        return loaded | self.load_vision_weights([(n, whole(t)) for n, t in vision])

    def _expected_loads(self, params: dict[str, nn.Parameter]) -> list[str]:
        """The text model's (the vision half checks its own)."""
        text = {n: p for n, p in params.items() if not n.startswith(self.VISION_PREFIXES)}
        return super()._expected_loads(text)  # type: ignore[misc]


def load_tower_and_projector(tower: Any, projector: nn.Module, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
    """A ``vision_tower.`` (``tower.load_weights``) and a ``multi_modal_projector.`` (every parameter) from the
    vision half's weights, as LLaVA and Gemma 3 name them."""
    part = [(n.removeprefix("vision_tower."), t) for n, t in weights if n.startswith("vision_tower.")]
    loaded = {f"vision_tower.{n}" for n in tower.load_weights(part)}
    proj = {n.removeprefix("multi_modal_projector."): t for n, t in weights if n.startswith("multi_modal_projector.")}
    return loaded | {f"multi_modal_projector.{n}" for n in load_module(projector, proj, "projector")}


def load_module(module: nn.Module, weights: dict[str, torch.Tensor], what: str) -> set[str]:
    """Every parameter of ``module`` from ``weights`` (its own names), shapes checked; a missing or unexpected
    name is an error naming ``what``."""
    params = dict(module.named_parameters())
    if set(weights) != set(params):
        missing, extra = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
        raise UnsupportedModelError(f"the {what}'s weights do not match: missing {missing[:8]}, unexpected {extra[:8]}")
    for n, t in weights.items():
        if params[n].shape != t.shape:
            raise UnsupportedModelError(
                f"{what} weight {n!r} has shape {tuple(t.shape)}, expected {tuple(params[n].shape)}"
            )
        params[n].data.copy_(t)
    return set(weights)


def whole(tensor: Any) -> torch.Tensor:
    """A tensor, or a lazy checkpoint slice read whole (the vision half is replicated on every rank)."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.narrow(0, 0, tensor.shape[0])
