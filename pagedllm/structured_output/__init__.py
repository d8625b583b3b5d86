"""Structured outputs: a grammar per constrained request, a token bitmask per step.

The :class:`StructuredOutputManager` sits beside the scheduler in the engine core. It
compiles each request's grammar once, in a thread pool (a cache keyed by the spec
shares compiles between requests); the request waits as ``WAITING_FOR_GRAMMAR``
outside the scheduler meanwhile, so nobody else waits for it. Each step it fills
the bitmask rows of the requests that will sample (with speculative decoding one
row per verified position, the matcher advanced through the drafts before it and
rolled back after); the sampler only applies the mask. After the step it advances
each matcher with the tokens the request kept, and cuts each new draft list at the
first token the grammar would refuse.

Two backends, both real libraries: ``xgrammar`` (the default) and ``guidance``
(llguidance). ``auto`` takes xgrammar and falls back to llguidance for a spec xgrammar
refuses (a schema keyword it cannot enforce, say). A grammar library is imported
only here, and only when the first constrained request arrives.
"""

from pagedllm.structured_output.manager import BACKENDS, MAX_PENDING_COMPILES, StructuredOutputManager, allow_only

__all__ = ["BACKENDS", "MAX_PENDING_COMPILES", "StructuredOutputManager", "allow_only"]
