"""The OpenAI-compatible HTTP server (FastAPI); imported only by `pagedllm serve`."""
