from pagedllm.sample.sampler import Penalties, Sampler, SamplingBatch

__all__ = ["Penalties", "Sampler", "SamplingBatch"]
