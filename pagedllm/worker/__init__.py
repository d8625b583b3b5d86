"""Device-side work: loading the model, the KV cache, building each step's batch, sampling."""
