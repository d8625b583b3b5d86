from pagedllm.attention.backend import get_attention_backend
from pagedllm.attention.interface import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
