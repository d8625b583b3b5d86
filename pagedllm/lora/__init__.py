"""Multi-LoRA: many PEFT adapters over one base model, mixed in one batch.

``LoRARequest(name, int_id, path)`` names an adapter directory in PEFT's format
(``adapter_config.json`` + ``adapter_model.safetensors``). The engine loads it
once into a CPU cache (``max_cpu_loras``, LRU); a step's adapters sit in one of
``max_loras`` slots of every adapted linear (:mod:`pagedllm.lora.layers`), and the
scheduler admits a request only when its adapter can have a slot.
"""

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
