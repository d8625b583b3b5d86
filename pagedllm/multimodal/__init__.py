"""Image input: what a prompt's images become (:mod:`.inputs`), how they are read (:mod:`.media`) and
processed into placeholder tokens and pixel values (:mod:`.processing`)."""

from pagedllm.multimodal.inputs import MultiModalFeature

__all__ = ["MultiModalFeature"]
