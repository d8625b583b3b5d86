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
    pixel_values: Any  # torch.Tensor [3, H, W], as the checkpoint's processor made it

    @property
    def end(self) -> int:
        return self.offset + self.length


def content_hash(pixel_values: Any) -> str:
    """sha256 of a processed image: its shape, dtype and values."""
    t = pixel_values.contiguous()
    h = hashlib.sha256(f"{tuple(t.shape)}:{t.dtype}".encode())
    h.update(t.numpy().tobytes())
    return h.hexdigest()
