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
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagedllm.errors import InvalidParameterError

CONNECTORS = ("DiskConnector",)
ROLES = ("kv_both", "kv_producer", "kv_consumer")


@dataclass(slots=True, frozen=True)
class KVTransferConfig:
    """The checked ``--kv-transfer-config`` (vLLM's JSON object)."""
    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: Any) -> "KVTransferConfig | None":
        if raw is None:
            return None
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise InvalidParameterError(f"kv_transfer_config is not valid JSON: {e}", "kv_transfer_config") from None
        if not isinstance(raw, dict):
            raise InvalidParameterError("kv_transfer_config must be a JSON object", "kv_transfer_config")
        raw = dict(raw)
        name = raw.pop("kv_connector", None)
        if name not in CONNECTORS:
            raise InvalidParameterError(
                f"kv_transfer_config.kv_connector: unknown connector {name!r}; available: {', '.join(CONNECTORS)}",
                "kv_transfer_config.kv_connector")
        role = raw.pop("kv_role", "kv_both")
        if role not in ROLES:
            raise InvalidParameterError(f"kv_transfer_config.kv_role must be one of {list(ROLES)}, got {role!r}",
                                        "kv_transfer_config.kv_role")
        extra = raw.pop("kv_connector_extra_config", {})
        if not isinstance(extra, dict):
            raise InvalidParameterError("kv_transfer_config.kv_connector_extra_config must be a JSON object",
                                        "kv_transfer_config.kv_connector_extra_config")
        if raw:
            raise InvalidParameterError(
                f"kv_transfer_config: unknown keys {sorted(raw)}; valid: kv_connector, kv_role, "
                "kv_connector_extra_config", f"kv_transfer_config.{sorted(raw)[0]}")
        config = cls(name, role, extra)
        config.disk_options()  # raises on a bad option
        return config

    def disk_options(self) -> tuple[str, float]:
        """DiskConnector's (path, max_size_gb)."""
        extra = dict(self.kv_connector_extra_config)
        where = "kv_transfer_config.kv_connector_extra_config"
        path = extra.pop("path", None)
        if not isinstance(path, str) or not path:
            raise InvalidParameterError(f"{where}.path: DiskConnector needs the directory to keep blocks in",
                                        f"{where}.path")
        size = extra.pop("max_size_gb", 10)
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
            raise InvalidParameterError(f"{where}.max_size_gb must be > 0, got {size!r}", f"{where}.max_size_gb")
        if extra:
            raise InvalidParameterError(f"{where}: unknown keys {sorted(extra)}; valid: path, max_size_gb",
                                        f"{where}.{sorted(extra)[0]}")
        return path, float(size)


@dataclass(slots=True)
class KVConnectorMetadata:
    """What every rank's worker half does around this step's forward. Before it, in this order: deletes, saves
    into RAM (out of primary blocks the step may overwrite), loads (into blocks the step will read). After it:
    disk saves (of the blocks the step filled)."""
    saves: list[tuple[int, int]] = field(default_factory=list)  # (primary block id, RAM slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (RAM slot, primary block id)
    disk_deletes: list[bytes] = field(default_factory=list)  # block hashes whose files go
    disk_saves: list[tuple[int, bytes]] = field(default_factory=list)  # (primary block id, hash): after the forward
    disk_loads: list[tuple[bytes, int]] = field(default_factory=list)  # (hash, primary block id)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.disk_deletes or self.disk_saves or self.disk_loads)


@dataclass(slots=True)
class KVConnectorStats:
    """Since the last stats call. Tokens are prompt (or, resuming a preempted request, known) tokens."""
    queries: int = 0  # tokens looked up in the external tiers (past the primary cache's hit)
    hits: int = 0  # of which found there and loaded instead of computed
    ram_bytes_saved: int = 0
    ram_bytes_loaded: int = 0
    disk_bytes_saved: int = 0
    disk_bytes_loaded: int = 0
    swapped_out: int = 0  # preempted requests whose partial last block was swapped out
    save_seconds: float = 0.0  # worker time spent copying (the driver rank's)
    load_seconds: float = 0.0

    def take(self) -> "KVConnectorStats":
        old = KVConnectorStats(*(getattr(self, f) for f in self.__slots__))
        for f in self.__slots__:
            setattr(self, f, type(getattr(self, f))())
        return old
