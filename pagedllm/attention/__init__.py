from pagedllm.attention.backend import AttentionMetadata, get_attention_backend

__all__ = ["AttentionMetadata", "get_attention_backend"]
