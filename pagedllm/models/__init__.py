from pagedllm.models.registry import ModelRegistry

__all__ = ["ModelRegistry"]
