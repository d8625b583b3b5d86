"""Config and weights of a local Hugging Face directory (safetensors only)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pagedllm.errors import ModelNotFoundError, UnsupportedModelError

if TYPE_CHECKING:
    import torch
    import transformers

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
# Buffers some old checkpoints saved; they are recomputed from the config.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_hf_config(path: str) -> transformers.PretrainedConfig:
    """The checkpoint's config; for a vision-language model its text model's, with the whole config as
    ``multimodal_config`` and its ``architectures``: the engine sizes the KV cache, the vocabulary and the
    context from the text model's, and the model registry builds the multimodal class from it."""
    import copy

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if getattr(config, "vision_config", None) is None or getattr(config, "text_config", None) is None:
        return config
    text = copy.copy(config.get_text_config())
    text.multimodal_config = config
    # transformers ties the head by the whole config's flag (Qwen2-VL's text config does not repeat it)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
    return text


def safetensors_files(path: str) -> list[str]:
    """The safetensors files of the checkpoint in ``path``, in a stable order."""
    index = os.path.join(path, _INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not os.path.isfile(os.path.join(path, name))]
        if missing:
            raise ModelNotFoundError(f"{index} lists shard(s) that are not on disk: {', '.join(missing)}.")
        return [os.path.join(path, name) for name in files]
    if os.path.isfile(os.path.join(path, _SINGLE_FILE)):
        return [os.path.join(path, _SINGLE_FILE)]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if files:
        return [os.path.join(path, name) for name in files]
    torch_files = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth")))
    if torch_files:
        raise UnsupportedModelError(
            f"The model directory {path!r} has only PyTorch pickle weights "
            f"({', '.join(torch_files)}); pagedllm only loads *.safetensors. Convert it with "
            "`model.save_pretrained(dir, safe_serialization=True)`."
        )
    raise ModelNotFoundError(f"The model directory {path!r} has a config.json but no *.safetensors weights.")


def iter_raw(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A directory's safetensors tensors as stored (packed int32 must not pass through float32)."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  # safe_open has keys() but is not iterable
                yield name, f.get_tensor(name)


def iter_hf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, float32 tensor)`` one tensor at a time, never the whole model."""
    import torch

    for name, t in iter_raw(path):
        if not name.endswith(_SKIPPED_SUFFIXES):
            yield name, t.to(torch.float32)


def iter_hf_weight_slices(path: str) -> Iterator[tuple[str, LazyTensor]]:
    """Like :func:`iter_hf_weights`, but each value reads from disk only the part asked for
    (``narrow``): a tensor-parallel rank loads its shard, never the whole tensor."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  # safe_open has keys() but is not iterable
                if not name.endswith(_SKIPPED_SUFFIXES):
                    yield name, LazyTensor(f.get_slice(name))


class LazyTensor:
    """A tensor in a safetensors file, read on ``narrow`` (float32)."""

    def __init__(self, file_slice: Any):
        self._slice = file_slice
        self.shape = tuple(file_slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        import torch

        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index].to(torch.float32)
