"""Which adapter sits in which slot, and the per-step row grouping the LoRA linears read."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, cast

import torch
from torch import nn

from pagedllm.lora.adapter import AdapterCache
from pagedllm.lora.layers import LoRALinear, LoRAState, Rows
from pagedllm.lora.request import LoRARequest


def part_shapes(hf_config: Any) -> dict[str, list[tuple[int, int]]]:
    """(out, in) of each part of each adaptable module of a Llama-family model."""
    h = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    d = getattr(hf_config, "head_dim", None) or h // heads
    i = hf_config.intermediate_size
    return {
        "qkv_proj": [(heads * d, h), (kv * d, h), (kv * d, h)],
        "o_proj": [(h, heads * d)],
        "gate_up_proj": [(i, h), (i, h)],
        "down_proj": [(h, i)],
    }


class LoRAManager:
    """Wraps a model's projections in :class:`LoRALinear` and keeps ``max_loras`` adapters in their slots
    (least recently used out first), loading them from the shared :class:`AdapterCache`."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, cache: AdapterCache):
        self.state = LoRAState()
        self.cache = cache
        self.slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.free = list(range(max_loras - 1, -1, -1))  # slots holding no adapter
        shapes = part_shapes(model.config)
        self.layers: dict[str, LoRALinear] = {}
        for i, layer in enumerate(cast(nn.ModuleList, model.layers)):
            for owner, attr in (
                (layer.self_attn, "qkv_proj"),
                (layer.self_attn, "o_proj"),
                (layer.mlp, "gate_up_proj"),
                (layer.mlp, "down_proj"),
            ):
                wrapped = LoRALinear(
                    getattr(owner, attr), [out for out, _ in shapes[attr]], max_loras, max_rank, self.state
                )
                setattr(owner, attr, wrapped)
                self.layers[f"layers.{i}.{'self_attn' if owner is layer.self_attn else 'mlp'}.{attr}"] = wrapped

    def slot_for(self, req: LoRARequest, keep: set[int]) -> int:
        """The slot holding ``req``'s adapter, loading it (over the least recently used adapter not in
        ``keep``, this step's) when it is not there."""
        slot = self.slots.get(req.lora_int_id)
        if slot is not None:
            self.slots.move_to_end(req.lora_int_id)
            return slot
        if self.free:
            slot = self.free.pop()
        else:
            victim = next(i for i in self.slots if i not in keep)  # the scheduler admits <= max_loras adapters
            slot = self.slots.pop(victim)
        adapter = self.cache.get(req)
        for name, layer in self.layers.items():
            layer.set_slot(slot, [adapter.weights.get((name, j)) for j in range(len(layer.part_sizes))])
        self.slots[req.lora_int_id] = slot
        return slot

    def remove(self, lora_int_id: int) -> None:
        """Forget an unloaded adapter: its slot is free for the next one."""
        slot = self.slots.pop(lora_int_id, None)
        if slot is not None:
            self.free.append(slot)

    def segments(self, row_ranges: list[tuple[LoRARequest | None, int, int]]) -> list[tuple[int, Rows]]:
        """Group a step's rows by slot: ``row_ranges`` is (adapter or None, first row, end) per request."""
        keep = {req.lora_int_id for req, _, _ in row_ranges if req is not None}
        by_slot: dict[int, list[tuple[int, int]]] = {}
        for req, a, b in row_ranges:
            if req is not None and b > a:
                by_slot.setdefault(self.slot_for(req, keep), []).append((a, b))
        out: list[tuple[int, Rows]] = []
        for slot, ranges in by_slot.items():
            merged: list[tuple[int, int]] = []
            for a, b in sorted(ranges):
                if merged and merged[-1][1] == a:
                    merged[-1] = (merged[-1][0], b)
                else:
                    merged.append((a, b))
            if len(merged) == 1:
                out.append((slot, slice(*merged[0])))
            else:
                out.append((slot, torch.cat([torch.arange(a, b) for a, b in merged])))
        return out
