"""One image of a prompt, as the engine carries it from the processor to the model runner."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class MultiModalFeature:
    """An image's place in the prompt and what its encoder reads.

    ``identifier`` is the sha256 of the processed pixels: the key of the encoder cache, and what the prefix
    cache's block hashes include for every block the image's placeholders touch (the placeholders are all the
    same token id, so the tokens alone cannot tell two images apart).
    """

    modality: str
    identifier: str
    offset: int  # the first placeholder token's position in the prompt
    length: int  # placeholder tokens: the encoder output's rows
    # torch.Tensor as the checkpoint's processor made it: [3, H, W] for a fixed-size family (LLaVA), the image's
    # flattened patches [t * h * w, channels * frames * patch²] for a dynamic-resolution one (Qwen2-VL)
    pixel_values: Any
    grid_thw: tuple[int, int, int] | None = None  # a dynamic-resolution image's patch grid (frames, rows, columns)

    @property
    def end(self) -> int:
        return self.offset + self.length


def content_hash(pixel_values: Any, grid_thw: tuple[int, int, int] | None = None) -> str:
    """sha256 of a processed image: its shape, grid, dtype and values."""
    t = pixel_values.contiguous()
    h = hashlib.sha256(f"{tuple(t.shape)}:{grid_thw}:{t.dtype}".encode())
    h.update(t.numpy().tobytes())
    return h.hexdigest()
