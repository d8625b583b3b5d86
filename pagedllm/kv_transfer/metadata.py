"""What the connector's two halves pass each other: the step's metadata (scheduler half -> every rank's worker
half, inside the SchedulerOutput) and the transfer stats."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    remote_pulls: list[RemotePull] = field(default_factory=list)  # MooncakeConnector: blocks to read from a producer

    def __bool__(self) -> bool:
        return bool(
            self.saves or self.loads or self.disk_deletes or self.disk_saves or self.disk_loads or self.remote_pulls
        )


@dataclass(slots=True)
class RemotePull:
    """MooncakeConnector: read a producer's blocks of one prefilled request into this engine's blocks, then
    release them on the producer (whose answer says whether they stayed held throughout the read). With no
    blocks it is only the release (the prompt was computed here after all)."""

    session: str  # the producer's transfer engine, "host:rpc_port"
    side_channel: tuple[str, int]  # the producer's release channel
    engine_id: str  # the producer engine (a restarted one has another)
    remote_request_id: str
    base: int  # the producer's KV cache buffer: its address and blocks per layer
    num_blocks: int
    where: str  # mooncake.where_digest of the producer's blocks, base and num_blocks: checked at the release
    blocks: list[tuple[int, int]] = field(default_factory=list)  # (producer block id, local block id)


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
    # MooncakeConnector: a consumer's pulls (bytes, requests, failed ones: recomputed), a producer's blocks held
    # for consumers (requests now; bytes released after a consumer read them; holds that timed out unread)
    remote_bytes_pulled: int = 0
    remote_pulls: int = 0
    remote_pull_failures: int = 0
    remote_bytes_served: int = 0
    remote_hold_timeouts: int = 0
    remote_pending: int = 0  # a gauge: the producer's requests whose blocks wait for a consumer, now
    save_seconds: float = 0.0  # worker time spent copying (the driver rank's)
    load_seconds: float = 0.0

    def take(self) -> KVConnectorStats:
        old = KVConnectorStats(*(getattr(self, f) for f in self.__slots__))
        for f in self.__slots__:
            setattr(self, f, type(getattr(self, f))())
        return old
