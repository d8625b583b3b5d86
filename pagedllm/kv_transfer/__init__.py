"""KV connectors: KV blocks that live outside the primary cache, behind one interface in two halves.

As vLLM V1 splits it, a connector has a **scheduler half** (in the engine core,
next to the block pool) and a **worker half** (in every rank, next to the KV
cache tensors). They talk only through the step's ``SchedulerOutput``: the
scheduler half fills a :class:`KVConnectorMetadata` (which blocks to save where,
which to load from where) and every rank's worker half carries it out around the
forward pass (copies in and out of RAM before it, disk writes of the blocks it
filled after it). So the connector works unchanged under every executor
(uniproc, mp, ray) and with tensor or pipeline parallelism (each rank copies
its own shard, at the same slot indices).

The scheduler half is asked, at admission, how many of a request's tokens past
its primary prefix-cache hit an external store holds (by the chained block
hashes); the scheduler counts those tokens as computed, under the same
``num_computed_tokens`` rule as a primary hit, and the worker half loads them
into the freshly allocated blocks before anything reads them.

The block pool stays the single owner of primary blocks: a connector only
hears about a cached block when the pool evicts it (and may save it then), and
gets new blocks only through the scheduler's normal allocation.

Two connectors: the offload tiers (:mod:`~pagedllm.kv_transfer.offload`: a RAM
pool, and ``DiskConnector``'s directory, found by block hash) and
``MooncakeConnector`` (:mod:`~pagedllm.kv_transfer.mooncake`: a decode engine
reads one request's blocks straight out of its prefill engine's cache, where
the producer holds them for it through the block pool's ``hold``).
"""

from pagedllm.kv_transfer.config import CONNECTORS, ROLES, KVTransferConfig
from pagedllm.kv_transfer.metadata import KVConnectorMetadata, KVConnectorStats

__all__ = ["CONNECTORS", "ROLES", "KVConnectorMetadata", "KVConnectorStats", "KVTransferConfig"]
