from pagedllm.sample.sampler import Sampler, SamplingBatch

__all__ = ["Sampler", "SamplingBatch"]
