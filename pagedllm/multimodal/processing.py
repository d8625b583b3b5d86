"""A prompt with images → token ids with each image's placeholders expanded, and one
:class:`~pagedllm.multimodal.inputs.MultiModalFeature` per image.

The checkpoint's own transformers processor does the work (resizing, normalising, expanding ``<image>``
into the image's tokens), so the number of image tokens is the Hugging Face processor's by construction. A text
prompt goes through the processor whole; a token-id prompt carries one image token per image, which is expanded
to the image's count.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence
from typing import Any

from pagedllm.errors import InvalidParameterError, UnsupportedModelError
from pagedllm.multimodal.inputs import MultiModalFeature, content_hash
from pagedllm.multimodal.media import load_image

FIELD = "multi_modal_data.image"


class MultiModalProcessor:
    def __init__(self, path: str, hf_config: Any, config: Any):
        """``hf_config``: the text view (``multimodal_config`` set); ``config``: the engine's MultiModalSection."""
        self.path = path
        self.hf_config = hf_config
        self.config = config
        self.limits = config.limits()
        mm = hf_config.multimodal_config
        self.image_token_id = int(mm.image_token_id)
        self.patch_size = int(mm.vision_config.patch_size)  # where a LLaVA processor does not say its own
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
                if self.hf_config.multimodal_config.model_type in SPLIT_PROCESSOR_TYPES:
                    self._hf = SplitProcessor(self.path)
                else:
                    from transformers import AutoProcessor

                    self._hf = AutoProcessor.from_pretrained(self.path, local_files_only=True)
            return self._hf

    @functools.cached_property
    def max_tokens_per_image(self) -> int:
        """The placeholder tokens of the largest image the processor makes: any image's for a fixed grid
        (LLaVA, Gemma 3), the pixel limit's for dynamic resolution (Qwen2-VL: ``max_pixels`` in merged
        patches)."""
        ip = self.hf_processor.image_processor
        merge = getattr(ip, "merge_size", None)
        if merge is not None:
            size = getattr(ip, "size", None) or {}
            max_pixels = getattr(ip, "max_pixels", None) or size.get("longest_edge") or size.get("max_pixels")
            if max_pixels is None:
                raise UnsupportedModelError(f"{self.path}: its image processor states no max_pixels")
            return int(max_pixels) // (int(ip.patch_size) * int(merge)) ** 2
        return self._counts([self._probe], [None])[0]

    def check_matches_model(self, name: str) -> None:
        """The processor makes what the vision tower reads (a start-up check): for a fixed grid, as many
        placeholders as the tower gives rows; for dynamic resolution, the tower's patch and merge sizes."""
        mm = self.hf_config.multimodal_config
        ip = self.hf_processor.image_processor
        if getattr(ip, "merge_size", None) is not None:
            vc = mm.vision_config
            made = (int(ip.patch_size), int(ip.merge_size), int(ip.temporal_patch_size))
            expected = (int(vc.patch_size), int(vc.spatial_merge_size), int(vc.temporal_patch_size))
            if made != expected:
                raise UnsupportedModelError(
                    f"{name}: its processor cuts images into patches of {made[0]} pixels, merged {made[1]}x{made[1]}"
                    f" over {made[2]} frames, but its vision tower takes {expected[0]}, {expected[1]}x"
                    f"{expected[1]} and {expected[2]}"
                )
            return
        if getattr(self.hf_processor, "image_seq_length", None) is not None:  # Gemma 3
            size = tuple(int(n) for n in self._probe.shape[-2:])
            if size != (mm.vision_config.image_size,) * 2 or self.max_tokens_per_image != mm.mm_tokens_per_image:
                raise UnsupportedModelError(
                    f"{name}: its processor makes {size[0]}x{size[1]} images of {self.max_tokens_per_image} tokens,"
                    f" but its vision tower takes {mm.vision_config.image_size} pixels a side and gives "
                    f"{mm.mm_tokens_per_image} tokens"
                )
            return
        from pagedllm.models.llava import image_tokens

        expected_rows, made_rows = image_tokens(mm), self.max_tokens_per_image
        if made_rows != expected_rows:
            raise UnsupportedModelError(
                f"{name}: its processor makes {made_rows} placeholder tokens an image, but its vision tower "
                f"gives {expected_rows} rows; the processor's image size or patch size does not match the tower's"
            )

    @functools.cached_property
    def _probe(self) -> Any:
        """A fixed-size processor's pixels for any image (one 224x224 image processed once)."""
        from PIL import Image

        return self.hf_processor.image_processor([Image.new("RGB", (224, 224))], return_tensors="pt")["pixel_values"][0]

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
        from_text = ids is None
        if ids is None and isinstance(hf, SplitProcessor):
            assert text is not None
            ids = hf.tokenizer.encode(text, add_special_tokens=add_special_tokens)
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
            pixels, grids = _per_image(out)
        else:
            try:
                pixels, grids = _per_image(hf.image_processor(images, return_tensors="pt"))
            except ValueError as e:  # the image processor's own checks (Qwen2-VL: an aspect ratio over 200)
                raise InvalidParameterError(f"{FIELD}: {e}", FIELD) from None
            if getattr(hf, "image_seq_length", None) is not None:  # Gemma 3: <start_of_image> marks each image
                marker = hf.tokenizer.convert_tokens_to_ids(hf.boi_token)
                sequence = hf.tokenizer.encode(hf.full_image_sequence, add_special_tokens=False)
                ids = self._expand(ids, marker, [sequence] * len(images), from_text)
            else:
                counts = self._counts(pixels, grids)
                ids = self._expand(ids, self.image_token_id, [[self.image_token_id] * n for n in counts], from_text)
        counts = self._counts(pixels, grids)
        places = _split(_runs(ids, self.image_token_id), counts)
        if places is None:
            raise InvalidParameterError(self._mismatch(len(images)), FIELD)
        features = []
        for i, ((offset, length), pv, grid) in enumerate(zip(places, pixels, grids)):
            if length > self.max_image_tokens:
                raise InvalidParameterError(
                    f"{FIELD}[{i}]: the image takes {length} tokens, more than the encoder's step budget or cache "
                    f"holds ({self.max_image_tokens}: max_num_encoder_input_tokens, encoder_cache_size)",
                    FIELD,
                )
            features.append(MultiModalFeature("image", content_hash(pv, grid), offset, length, pv, grid))
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

    def _counts(self, pixels: list[Any], grids: list[tuple[int, int, int] | None]) -> list[int]:
        """Each processed image's number of placeholder tokens, as the checkpoint's processor counts them
        (``LlavaProcessor``: a token per patch of the processed image, the class token counted or not;
        ``Qwen2VLProcessor``: a token per merged block of its grid)."""
        hf = self.hf_processor
        if getattr(hf, "image_seq_length", None) is not None:  # Gemma 3: pooled to a fixed count
            return [int(hf.image_seq_length)] * len(pixels)
        if grids and grids[0] is not None:
            merge = int(hf.image_processor.merge_size)
            return [t * h * w // merge**2 for t, h, w in grids]  # type: ignore[misc]
        patch = getattr(hf, "patch_size", None) or self.patch_size
        strategy = getattr(hf, "vision_feature_select_strategy", None) or self.select_strategy
        extra = (getattr(hf, "num_additional_image_tokens", 0) or 0) - (1 if strategy == "default" else 0)
        return [(int(p.shape[-2]) // patch) * (int(p.shape[-1]) // patch) + extra for p in pixels]

    def _expand(self, ids: list[int], marker: int, sequences: list[list[int]], from_text: bool) -> list[int]:
        """Each image's one ``marker`` token → its sequence (its placeholders: as many image tokens as it takes;
        Gemma 3: the processor's whole image sequence, tokenized on its own, as vLLM does)."""
        at = [i for i, t in enumerate(ids) if t == marker]
        if len(at) != len(sequences):
            if from_text:
                raise InvalidParameterError(self._mismatch(len(sequences)), FIELD)
            raise InvalidParameterError(
                f"prompt_token_ids must hold one {self.hf_processor.tokenizer.convert_ids_to_tokens(marker)} "
                f"({marker}) per image: {len(at)} for {len(sequences)} image(s)",
                FIELD,
            )
        out: list[int] = []
        last = 0
        for offset, sequence in zip(at, sequences):
            out += ids[last:offset] + sequence
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


# families whose transformers processor needs torchvision (for its video half): their text is tokenized and each
# image token expanded here, as for token-id prompts
SPLIT_PROCESSOR_TYPES = ("qwen2_vl", "qwen2_5_vl")


class SplitProcessor:
    """A checkpoint's tokenizer and image processor, standing in for its composite processor (whose video half
    needs torchvision): the same attributes the engine reads."""

    def __init__(self, path: str):
        import os

        from transformers import AutoImageProcessor, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        self.image_token = "<|image_pad|>"
        self.chat_template = self.tokenizer.chat_template
        for name in ("chat_template.jinja", "chat_template.json"):  # the processor's own, where it has one
            file = os.path.join(path, name)
            if os.path.isfile(file):
                with open(file, encoding="utf-8") as f:
                    text = f.read()
                self.chat_template = json.loads(text)["chat_template"] if name.endswith(".json") else text
                break


def _per_image(out: Any) -> tuple[list[Any], list[tuple[int, int, int] | None]]:
    """A processor's output as one pixel tensor per image and its grid: LLaVA's ``pixel_values`` is
    ``[images, 3, H, W]``; Qwen2-VL's holds every image's patches one after another, ``image_grid_thw`` saying
    how many are each image's."""
    pixels = out["pixel_values"]
    grid = out.get("image_grid_thw")
    if grid is None:
        return list(pixels), [None] * len(pixels)
    grids = [(int(t), int(h), int(w)) for t, h, w in grid.tolist()]
    return list(pixels.split([t * h * w for t, h, w in grids])), list(grids)


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
