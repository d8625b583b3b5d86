"""How a model is split over the ranks: each pipeline stage's layers, and a clear error where it cannot be."""

from __future__ import annotations

from typing import Any

from pagedllm.errors import InvalidParameterError


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """The ``[start, end)`` layers of a pipeline stage: an even split, the first stages taking the remainder."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def check_parallel_fits(hf_config: Any, tp_size: int, pp_size: int, expert_parallel: bool = False) -> None:
    """A clear start-up error where the model cannot be split this way."""
    experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None) or 0
    if experts and tp_size > 1 and not expert_parallel:
        raise InvalidParameterError(
            f"tensor parallelism of a Mixture-of-Experts model needs enable_expert_parallel "
            f"(--enable-expert-parallel): its {experts} experts are shared out whole",
            "enable_expert_parallel",
        )
    if experts and experts % tp_size:
        raise InvalidParameterError(
            f"tensor_parallel_size={tp_size} does not divide the model's {experts} experts", "tensor_parallel_size"
        )
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    layers = hf_config.num_hidden_layers
    if heads % tp_size:
        raise InvalidParameterError(
            f"tensor_parallel_size={tp_size} does not divide the model's {heads} attention heads; "
            f"choose one of {[d for d in range(1, heads + 1) if heads % d == 0]}",
            "tensor_parallel_size",
        )
    if kv_heads % tp_size and tp_size % kv_heads:
        raise InvalidParameterError(
            f"tensor_parallel_size={tp_size} neither divides nor is a multiple of the model's {kv_heads} "
            "key/value heads",
            "tensor_parallel_size",
        )
    if hf_config.intermediate_size % tp_size:
        raise InvalidParameterError(
            f"tensor_parallel_size={tp_size} does not divide the MLP size {hf_config.intermediate_size}",
            "tensor_parallel_size",
        )
    if pp_size > layers:
        raise InvalidParameterError(
            f"pipeline_parallel_size={pp_size} is more than the model's {layers} layers", "pipeline_parallel_size"
        )
