"""LoRARequest: which adapter a request runs with."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.errors import InvalidParameterError


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter for a request, with vLLM's field names. ``lora_int_id`` (>= 1) identifies the adapter:
    requests naming the same id share its weights and its prefix-cache entries."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise InvalidParameterError(
                f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}", "lora_request.lora_int_id"
            )
        if not self.lora_name:
            raise InvalidParameterError("lora_name must not be empty", "lora_request.lora_name")
