"""Loading PEFT LoRA adapters, and the CPU cache they live in between uses."""

from __future__ import annotations

import json
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.errors import InvalidParameterError
from pagedllm.lora.request import LoRARequest

# transformers' projection names we can adapt -> (our fused module, part index within it)
ADAPTABLE = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter's weights, keyed by our module (``layers.3.self_attn.qkv_proj``) and part index:
    ``A`` [r, in], ``B`` [out_part, r] already multiplied by the scale (alpha / r, or alpha / sqrt(r))."""

    request: LoRARequest
    rank: int
    weights: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]


def _bad(req: LoRARequest, msg: str) -> InvalidParameterError:
    return InvalidParameterError(f"LoRA adapter {req.lora_name!r} ({req.lora_path}): {msg}", "lora_request")


def load_adapter(
    req: LoRARequest,
    max_rank: int,
    num_layers: int,
    part_shapes: dict[str, list[tuple[int, int]]],
    base_model: str | None = None,
) -> LoRAAdapter:
    """Read and check a PEFT LoRA directory. ``part_shapes`` maps each adaptable module kind
    (``qkv_proj``, ...) to its parts' (out, in) shapes; a module the model lacks, a shape that does not
    fit, a rank above ``max_rank`` or a missing file each raise a clear error."""
    path = req.lora_path
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise _bad(req, "no adapter_config.json there (a PEFT LoRA adapter directory is expected)")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _bad(req, f"peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(key) == bad:
            raise _bad(req, f"{key}={bad} is not supported")
    if cfg.get("bias", "none") != "none":
        raise _bad(req, f"bias={cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise _bad(req, f"modules_to_save {cfg['modules_to_save']} is not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise _bad(req, "per-module rank_pattern / alpha_pattern is not supported")
    rank = int(cfg.get("r", 8))
    if rank > max_rank:
        raise _bad(req, f"rank {rank} is above max_lora_rank={max_rank}")
    alpha = float(cfg.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    expected = req.base_model_name or base_model
    named = cfg.get("base_model_name_or_path")
    if (
        req.base_model_name is not None
        and named
        and os.path.basename(str(named).rstrip("/")) != os.path.basename(str(expected).rstrip("/"))
    ):
        raise _bad(req, f"it was trained on {named!r}, not on {expected!r}")
    tensors = _read_tensors(req, path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        stem = name.removeprefix("base_model.model.").removeprefix("model.")
        for kind in ("lora_A", "lora_B"):
            marker = f".{kind}."
            if marker in stem:
                pairs.setdefault(stem.split(marker)[0], {})[kind] = t
                break
        else:
            if "lora_embedding" in stem or stem.startswith("lm_head") or "embed_tokens" in stem:
                raise _bad(req, f"{name}: LoRA on the embedding or the logits head is not supported")
            raise _bad(req, f"unexpected tensor {name!r}")
    weights: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise _bad(req, f"{module} has {sorted(ab)} but needs lora_A and lora_B")
        parts = module.split(".")
        if len(parts) != 4 or parts[0] != "layers" or parts[-1] not in ADAPTABLE:
            raise _bad(
                req,
                f"module {module!r} is not one this model can adapt (attention and MLP projections: "
                f"{', '.join(ADAPTABLE)})",
            )
        layer = int(parts[1])
        if layer >= num_layers:
            raise _bad(req, f"module {module!r}: the model has {num_layers} layers")
        fused, part = ADAPTABLE[parts[-1]]
        if fused not in part_shapes:
            raise _bad(req, f"module {module!r}: the model has no {fused}")
        out_features, in_features = part_shapes[fused][part]
        a, b = ab["lora_A"].float(), ab["lora_B"].float()
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise _bad(
                req,
                f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit rank {rank} "
                f"and the base layer's ({out_features}, {in_features})",
            )
        weights[(f"layers.{layer}.{parts[2]}.{fused}", part)] = (a.contiguous(), (b * scale).contiguous())
    if not weights:
        raise _bad(req, "it holds no LoRA weights")
    return LoRAAdapter(req, rank, weights)


def _read_tensors(req: LoRARequest, path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        return load_file(st)
    pt = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise _bad(req, "no adapter_model.safetensors (or adapter_model.bin) there")


class AdapterCache:
    """Adapters loaded in memory, least recently used evicted beyond ``capacity``. Thread-safe: the
    request thread loads (and so validates) an adapter when a request names it; the engine reads it."""

    def __init__(self, capacity: int, loader: Any):
        self.capacity = capacity
        self._loader = loader
        self._items: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, req: LoRARequest) -> LoRAAdapter:
        with self._lock:
            hit = self._items.get(req.lora_int_id)
            if hit is not None and hit.request.lora_path == req.lora_path:
                self._items.move_to_end(req.lora_int_id)
                return hit
        adapter = self._loader(req)  # outside the lock: reading a file must not block the engine
        with self._lock:
            self._items[req.lora_int_id] = adapter
            self._items.move_to_end(req.lora_int_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return adapter

    def remove(self, lora_int_id: int) -> None:
        with self._lock:
            self._items.pop(lora_int_id, None)

    def ids(self) -> list[int]:
        with self._lock:
            return list(self._items)
