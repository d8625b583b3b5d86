"""A prompt with images → token ids with each image's placeholders expanded, and one
:class:`~pagedllm.multimodal.inputs.MultiModalFeature` per image.

The checkpoint's own transformers processor does the work (resizing, normalising, expanding ``<image>``
into the image's tokens), so the number of image tokens is the Hugging Face processor's by construction. A text
prompt goes through the processor whole; a token-id prompt carries one image token per image, which is expanded
to the image's count.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from pagedllm.errors import InvalidParameterError
from pagedllm.multimodal.inputs import MultiModalFeature, content_hash
from pagedllm.multimodal.media import load_image

FIELD = "multi_modal_data.image"


class MultiModalProcessor:
    def __init__(self, path: str, hf_config: Any, config: Any):
        """``hf_config``: the text view (``multimodal_config`` set); ``config``: the engine's MultiModalSection."""
        self.path = path
        self.config = config
        self.limits = config.limits()
        mm = hf_config.multimodal_config
        self.image_token_id = int(mm.image_token_id)
        self.patch_size = int(mm.vision_config.patch_size)  # where the processor does not say its own
        self.select_strategy = getattr(mm, "vision_feature_select_strategy", "default")
        # without chunked prefill a prompt's images are all encoded in its one step (the engine sets it)
        self.max_prompt_image_tokens: int | None = None
        self.max_image_tokens = 1 << 62  # the most placeholder tokens one image may have (the engine sets it)
        self._hf: Any = None
        self._lock = threading.Lock()

    @property
    def hf_processor(self) -> Any:
        with self._lock:  # requests are processed on several threads
            if self._hf is None:
                from transformers import AutoProcessor

                self._hf = AutoProcessor.from_pretrained(self.path, local_files_only=True)
            return self._hf

    def max_tokens_per_image(self) -> int:
        """The placeholder tokens of the largest image the processor makes (a fixed grid: any image's)."""
        from PIL import Image

        pixels = self.hf_processor.image_processor([Image.new("RGB", (224, 224))], return_tensors="pt")["pixel_values"]
        return self._counts(pixels)[0]

    def chat_template(self) -> str | None:
        return getattr(self.hf_processor, "chat_template", None)

    def process(
        self, text: str | None, ids: list[int] | None, data: Any, add_special_tokens: bool = True
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """``data``: the prompt's ``multi_modal_data``. Returns the expanded token ids and the images."""
        images = self._images(data)
        if not images:
            if text is not None and ids is None:
                ids = self.hf_processor.tokenizer.encode(text, add_special_tokens=add_special_tokens)
            assert ids is not None
            self.check_no_placeholders(ids)
            return ids, []
        hf = self.hf_processor
        if ids is None:
            assert text is not None
            placeholder = self._token_text()
            if text.count(placeholder) != len(images):
                raise InvalidParameterError(self._mismatch(len(images)), FIELD)
            try:
                out = hf(text=text, images=images, return_tensors="pt", add_special_tokens=add_special_tokens)
            except ValueError as e:  # the processor's own checks
                raise InvalidParameterError(f"{FIELD}: {e}", FIELD) from None
            ids = out["input_ids"][0].tolist()
            pixels = out["pixel_values"]
        else:
            pixels = hf.image_processor(images, return_tensors="pt")["pixel_values"]
            ids = self._expand(ids, pixels)
        counts = self._counts(pixels)
        places = _split(_runs(ids, self.image_token_id), counts)
        if places is None:
            raise InvalidParameterError(self._mismatch(len(images)), FIELD)
        features = []
        for i, ((offset, length), pv) in enumerate(zip(places, pixels)):
            if length > self.max_image_tokens:
                raise InvalidParameterError(
                    f"{FIELD}[{i}]: the image takes {length} tokens, more than the encoder's step budget or cache "
                    f"holds ({self.max_image_tokens}: max_num_encoder_input_tokens, encoder_cache_size)",
                    FIELD,
                )
            features.append(MultiModalFeature("image", content_hash(pv), offset, length, pv))
        total = sum(f.length for f in features)
        if self.max_prompt_image_tokens is not None and total > self.max_prompt_image_tokens:
            raise InvalidParameterError(
                f"the prompt's images take {total} tokens, more than one step's encoder budget and cache hold "
                f"({self.max_prompt_image_tokens}); without chunked prefill all of a prompt's images are encoded in "
                "its one step: send fewer images, or raise max_num_encoder_input_tokens and encoder_cache_size",
                FIELD,
            )
        return ids, features

    def image_items(self, data: Any) -> list[Any]:
        """``multi_modal_data``'s images as given (URLs, bytes, PIL images), checked against the limits."""
        if not isinstance(data, dict):
            raise InvalidParameterError("multi_modal_data must be a dict such as {'image': image}", "multi_modal_data")
        unknown = set(data) - {"image"}
        if unknown:
            raise InvalidParameterError(
                f"multi_modal_data: unsupported modality {sorted(unknown)[0]!r}; supported: image", "multi_modal_data"
            )
        raw = data.get("image")
        items: Sequence[Any] = [] if raw is None else raw if isinstance(raw, (list, tuple)) else [raw]
        limit = self.limits.get("image", 0)
        if len(items) > limit:
            raise InvalidParameterError(
                f"the prompt has {len(items)} images, more than limit_mm_per_prompt allows ({limit})", FIELD
            )
        return list(items)

    def load(self, item: Any, index: int) -> Any:
        """One image read (fetched, decoded) under the limits: an RGB PIL image."""
        return load_image(item, self.config, f"{FIELD}[{index}]")

    def _images(self, data: Any) -> list[Any]:
        return [self.load(item, i) for i, item in enumerate(self.image_items(data))]

    def _counts(self, pixels: Any) -> list[int]:
        """Each processed image's number of placeholder tokens, as the checkpoint's processor counts them
        (``LlavaProcessor``: a token per patch of the processed image, the class token counted or not)."""
        hf = self.hf_processor
        patch = getattr(hf, "patch_size", None) or self.patch_size
        strategy = getattr(hf, "vision_feature_select_strategy", None) or self.select_strategy
        extra = (getattr(hf, "num_additional_image_tokens", 0) or 0) - (1 if strategy == "default" else 0)
        return [(int(p.shape[-2]) // patch) * (int(p.shape[-1]) // patch) + extra for p in pixels]

    def _expand(self, ids: list[int], pixels: Any) -> list[int]:
        """One placeholder token per image → each image's count of them."""
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != len(pixels):
            raise InvalidParameterError(
                f"prompt_token_ids must hold one image token ({self.image_token_id}) per image: "
                f"{len(at)} for {len(pixels)} image(s)",
                FIELD,
            )
        out: list[int] = []
        last = 0
        for offset, count in zip(at, self._counts(pixels)):
            out += ids[last:offset] + [self.image_token_id] * count
            last = offset + 1
        return out + ids[last:]

    def check_no_placeholders(self, ids: list[int]) -> None:
        if self.image_token_id in ids:
            raise InvalidParameterError(
                f"the prompt holds image placeholder tokens ({self._token_text()}) but no image", "prompt"
            )

    def _mismatch(self, num_images: int) -> str:
        return (
            f"the prompt's image placeholders do not match its {num_images} image(s): put one "
            f"{self._token_text()} where each image goes (a chat message's image part does it)"
        )

    def _token_text(self) -> str:
        return str(getattr(self.hf_processor, "image_token", None) or f"token {self.image_token_id}")


def _split(runs: list[tuple[int, int]], counts: list[int]) -> list[tuple[int, int]] | None:
    """Each image's (offset, length) in the placeholder runs (images side by side share a run), or None where
    the runs are not the images' counts in order."""
    out: list[tuple[int, int]] = []
    k = 0
    for start, length in runs:
        while length > 0:
            if k == len(counts) or counts[k] > length:
                return None
            out.append((start, counts[k]))
            start, length, k = start + counts[k], length - counts[k], k + 1
    return out if k == len(counts) else None


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of ``token`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    i, n = 0, len(ids)
    while i < n:
        if ids[i] == token:
            j = i
            while j < n and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs
