"""Maps a checkpoint's `architectures` name to the model class that runs it.

Users add their own with ``ModelRegistry.register_model("MyArch", MyModelClass)``;
the class is built as ``cls(hf_config)`` and must offer ``forward(input_ids,
positions, kv_caches, attn_metadata)``, ``compute_logits(hidden)`` and
``load_weights(iterable of (name, tensor))`` like :class:`LlamaForCausalLM`.
"""

from __future__ import annotations

import importlib
from typing import Any

from pagedllm.errors import UnsupportedModelError

# name -> "module:Class" (imported lazily) or the class itself once registered by a user
_BUILTIN = {
    "LlamaForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pagedllm.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "pagedllm.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "pagedllm.models.llama:Qwen3ForCausalLM",
    "MixtralForCausalLM": "pagedllm.models.llama:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "pagedllm.models.llama:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "pagedllm.models.llama:Qwen3MoeForCausalLM",
    "Gemma3ForCausalLM": "pagedllm.models.gemma3:Gemma3ForCausalLM",
    "BertModel": "pagedllm.models.bert:BertModel",  # pooling (sentence embeddings)
    # vision-language: built over the text model's class (see resolve_for_config)
    "LlavaForConditionalGeneration": "pagedllm.models.llava:LlavaForConditionalGeneration",
    "Qwen2VLForConditionalGeneration": "pagedllm.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "pagedllm.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration",
    "Gemma3ForConditionalGeneration": "pagedllm.models.gemma3_vision:Gemma3ForConditionalGeneration",
}


# configs without `architectures` (e.g. built from GGUF metadata) are matched by model_type
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_vl_text": "Qwen2ForCausalLM",  # a Qwen2-VL's text model (its M-RoPE: pagedllm.models.qwen2_vl)
    "qwen2_5_vl_text": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "bert": "BertModel",
}


class _ModelRegistry:
    def __init__(self) -> None:
        self._models: dict[str, Any] = dict(_BUILTIN)

    def register_model(self, architecture: str, model_cls: type) -> None:
        self._models[architecture] = model_cls

    def get_supported_archs(self) -> list[str]:
        return sorted(self._models)

    def resolve_for_config(self, hf_config: Any) -> type:
        """The class that runs ``hf_config``; for a vision-language model's text view (``multimodal_config``
        set: see ``load_hf_config``), its multimodal class over the text model's."""
        mm = getattr(hf_config, "multimodal_config", None)
        if mm is not None:
            text_cls = self.resolve_for_config(_text_only(hf_config))
            cls = self.resolve(getattr(mm, "architectures", None))
            if not hasattr(cls, "for_text_model"):
                raise UnsupportedModelError(
                    f"{cls.__name__} has a vision_config and a text_config: a vision-language model's class must "
                    "build over its text model's (see pagedllm.models.vlm.VisionLanguageModel)"
                )
            return cls.for_text_model(text_cls)
        archs = getattr(hf_config, "architectures", None)
        if not archs:
            model_type: str = getattr(hf_config, "model_type", "")
            archs = [_MODEL_TYPE_TO_ARCH.get(model_type, "<unknown>")]
        return self.resolve(archs)

    def resolve(self, architectures: list[str] | None) -> type:
        for arch in architectures or []:
            if arch in self._models:
                entry = self._models[arch]
                if isinstance(entry, str):
                    module, name = entry.split(":")
                    entry = getattr(importlib.import_module(module), name)
                return entry
        raise UnsupportedModelError(
            f"model architecture(s) {architectures} not supported; supported: "
            f"{', '.join(self.get_supported_archs())}. Register your own with "
            "pagedllm.ModelRegistry.register_model(name, cls)"
        )


def _text_only(view: Any) -> Any:
    """A multimodal config's text view without the link to the whole (so it resolves as the text model)."""
    import copy

    text = copy.copy(view)
    del text.multimodal_config
    return text


ModelRegistry = _ModelRegistry()
