"""`pagedllm bench ...`: benchmarks with vLLM's definitions."""
