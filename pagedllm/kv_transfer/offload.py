"""The tiers behind the primary cache: a RAM pool (``--kv-offloading-size``) and a disk directory
(``DiskConnector``), both LRU and keyed by block hash, chained primary -> RAM -> disk.

Scheduler half (:class:`OffloadScheduler`) keeps the indexes: which hash sits in
which RAM slot, which the disk holds. Worker half (:class:`OffloadWorker`) holds
the pool tensors and the files, and copies. ::

    primary cache ──evict cached block──► save to a RAM slot (LRU drops the oldest slot to make room)
    a step fills a block ──right after its forward──► write to disk (write-through: survives a restart)
    admission: primary hit ──► RAM / disk hits (consecutive hashes) ──► load into new blocks, counted as computed

A block is saved when the primary pool evicts it, not before: a cached block
costs one copy only if it is about to be lost, and blocks that stay in the
primary cache cost nothing. With ``preemption_mode='swap'`` a preempted
request's partial last block (which has no hash, so would otherwise be lost)
is also saved, privately; its full blocks reach the pool like any other cached
block, when they are evicted. On resumption the request is restored from the
primary cache, the pool and its private block, and recomputes nothing else.

Within one step the worker half saves before it loads, and loads before the
forward pass, so a block evicted and reused in the same step is saved from
its old contents, and a hash saved this step can already be loaded this step.
Slots and files read this step are pinned until the step's metadata is built,
so LRU never hands a slot that is being loaded to a save, nor deletes such a file.
A disk block is counted only after the scheduler half has checked every rank's
file (header and checksum, see :mod:`pagedllm.kv_transfer.disk`).
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.kv_transfer.disk import DiskIndex, DiskStore
from pagedllm.kv_transfer.metadata import KVConnectorMetadata, KVConnectorStats
from pagedllm.request import Request


class OffloadScheduler:
    def __init__(
        self, num_slots: int, block_size: int, block_bytes: int, swap: bool = False, disk: DiskIndex | None = None
    ):
        self.num_slots = num_slots
        self.block_size = block_size
        self.block_bytes = block_bytes  # one block's K and V on every rank together
        self.swap = swap
        self.disk = disk
        self._free = list(range(num_slots - 1, -1, -1))
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self._swapped: dict[str, tuple[int, int]] = {}  # request id -> (slot of its partial block, tokens computed)
        self._pinned: set[int] = set()
        self._pinned_disk: set[bytes] = set()
        self._release: list[int] = []  # private slots loaded this step: free once the step's loads are sent
        self._meta = KVConnectorMetadata()
        self.stats = KVConnectorStats()

    def bind(self, kv: object) -> None:
        pass  # (the block pool tells it of evictions through on_evict)

    def start_step(self) -> None:
        pass

    def close(self) -> None:
        pass

    def idle_wake_s(self) -> float | None:
        return None

    def take_stats(self) -> KVConnectorStats:
        return self.stats.take()

    # -- lookups at admission -------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens past ``num_computed_tokens`` (the primary hit, block aligned) that the tiers can supply.
        Side-effect free but for pinning what it counted, so this step's evictions keep it."""
        if request.sampling_params.prompt_logprobs is not None:
            return 0  # every prompt position must be computed
        bs = self.block_size
        first = num_computed_tokens // bs
        last = (request.num_tokens - 1) // bs  # keep one token to compute: its logits sample the next
        n = 0
        for h in request.block_hashes[first:last]:
            slot = self._lru.get(h)
            if slot is not None:
                self._pinned.add(slot)
            elif self._readable_on_disk(h):
                self._pinned_disk.add(h)
            else:
                break
            n += 1
        tokens = n * bs
        swapped = self._swapped.get(request.request_id)
        if swapped is not None and first + n == swapped[1] // bs:
            slot, computed = swapped
            self._pinned.add(slot)
            tokens += min(computed, request.num_tokens - 1) - (first + n) * bs
        return tokens

    def _readable_on_disk(self, block_hash: bytes) -> bool:
        disk = self.disk
        if disk is None or not disk.loads or not disk.find(block_hash, self._pinned_disk):
            return False
        return block_hash in self._pinned_disk or disk.verify(block_hash)  # (pinned: checked this step)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_computed_tokens: int, num_external_tokens: int
    ) -> None:
        """The request got its blocks (``block_ids``: all of them): load the ones the tiers supply."""
        bs = self.block_size
        first = num_computed_tokens // bs
        full = num_external_tokens // bs
        for i in range(first, first + full):
            h = request.block_hashes[i]
            slot = self._lru.get(h)
            if slot is not None:
                self._lru.move_to_end(h)
                self._meta.loads.append((slot, block_ids[i]))
                self.stats.ram_bytes_loaded += self.block_bytes
            else:  # verified and pinned by the lookup
                assert self.disk is not None  # a block not in RAM was found on disk
                self.disk.touch(h)
                self._meta.disk_loads.append((h, block_ids[i]))
                self.stats.disk_bytes_loaded += self.block_bytes
        swapped = self._swapped.pop(request.request_id, None)
        if swapped is not None:
            if num_external_tokens % bs:  # the private partial block is restored
                self._meta.loads.append((swapped[0], block_ids[first + full]))
                self.stats.ram_bytes_loaded += self.block_bytes
                self._release.append(swapped[0])
            else:
                self._free.append(swapped[0])
        self.stats.queries += request.num_tokens - num_computed_tokens
        self.stats.hits += num_external_tokens

    # -- blocks leaving the primary cache ---------------------------------------------------------------------
    def on_primary_evict(self, block_id: int, block_hash: bytes) -> None:
        """The block pool is reusing a cached block: keep its contents in RAM."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            return  # no RAM tier, or every slot is being read this step: the block is simply lost
        self._lru[block_hash] = slot
        self._save(block_id, slot)

    def on_preempt(self, request: Request, block_ids: list[int]) -> None:
        """Swap mode: keep the partial last block of a preempted request (its full blocks are cached and
        reach RAM when evicted)."""
        computed = request.num_computed_tokens
        if not self.swap or computed % self.block_size == 0:
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._swapped[request.request_id] = (slot, computed)
        self._save(block_ids[computed // self.block_size], slot)
        self.stats.swapped_out += 1

    def on_scheduled(self, request: Request, blocks: list[KVCacheBlock], start: int, num_tokens: int) -> None:
        """This step computes tokens [start, start + num_tokens) of the request: write the blocks it fills
        through to disk, right after the forward pass (before the step's output is returned, so a consumer
        that hears of the request finds its blocks there)."""
        if self.disk is None or not self.disk.saves:
            return
        bs = self.block_size
        for i in range(start // bs, min((start + num_tokens) // bs, len(request.block_hashes))):
            h = request.block_hashes[i]
            if h in self.disk:
                self.disk.touch(h)
            elif self.disk.add(h, self._pinned_disk):
                self._meta.disk_saves.append((blocks[i].block_id, h))
                self.stats.disk_bytes_saved += self.block_bytes

    def on_load_failed(self, block_hashes: list[bytes | None]) -> None:
        for h in block_hashes:
            if h is not None and self.disk is not None:
                self.disk.drop(h)

    def request_finished(self, request: Request) -> None:
        swapped = self._swapped.pop(request.request_id, None)
        if swapped is not None:
            self._free.append(swapped[0])

    def _save(self, block_id: int, slot: int) -> None:
        self._meta.saves.append((block_id, slot))
        self.stats.ram_bytes_saved += self.block_bytes

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for h, slot in self._lru.items():  # the oldest entry not being read this step
            if slot not in self._pinned:
                del self._lru[h]
                return slot
        return None

    # -- one step ---------------------------------------------------------------------------------------------
    def build_connector_meta(self) -> KVConnectorMetadata | None:
        meta, self._meta = self._meta, KVConnectorMetadata()
        if len({s for _, s in meta.saves}) < len(meta.saves):  # a slot saved into twice: the last save holds
            meta.saves = [(b, s) for s, b in {s: b for b, s in meta.saves}.items()]
        if self.disk is not None:
            meta.disk_deletes, self.disk.deletes = self.disk.deletes, []
            meta.disk_saves = [(b, h) for b, h in meta.disk_saves if h in self.disk]  # not dropped meanwhile
        self._pinned.clear()
        self._pinned_disk.clear()
        self._free += self._release
        self._release = []
        return meta or None

    def has_pending(self) -> bool:
        return bool(self._meta) or bool(self.disk is not None and self.disk.deletes)

    def check_invariants(self) -> None:
        used = list(self._lru.values()) + [s for s, _ in self._swapped.values()] + self._release
        assert len(used) == len(set(used)), "a RAM slot is used twice"
        assert not set(used) & set(self._free), "a RAM slot is both used and free"
        assert len(used) + len(self._free) == self.num_slots, "RAM slots lost"


class OffloadWorker:
    """One rank's tiers: the RAM pool, per layer ``[2, num_slots, block_size, kv_heads, head_dim]`` like the
    cache, and the disk store."""

    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int, disk: DiskStore | None = None):
        self.kv_caches = kv_caches
        c = kv_caches[0]
        pin = c.device.type == "cuda" and num_slots > 0
        self.pool = [torch.empty((2, num_slots, *c.shape[2:]), dtype=c.dtype, pin_memory=pin) for _ in kv_caches]
        self.disk = disk
        self.block_shape = [len(kv_caches), 2, *c.shape[2:]]  # one block on disk: every layer's K and V
        self.save_seconds = self.load_seconds = 0.0
        self.failed: list[int] = []  # blocks this step could not load

    @property
    def _disk(self) -> DiskStore:
        assert self.disk is not None  # the scheduler half asks for disk work only with a disk tier
        return self.disk

    def execute(self, meta: KVConnectorMetadata) -> None:
        """Before the forward pass: deletes, saves into RAM, then loads (disk saves wait for the forward)."""
        t0 = time.perf_counter()
        for h in meta.disk_deletes:
            self._disk.delete(h)
        dev = self.kv_caches[0].device
        if meta.saves:
            blocks = torch.tensor([b for b, _ in meta.saves], device=dev)
            slots = torch.tensor([s for _, s in meta.saves])
            for cache, pool in zip(self.kv_caches, self.pool):
                pool.index_copy_(1, slots, cache.index_select(1, blocks).to("cpu"))
        t1 = time.perf_counter()
        self.save_seconds += t1 - t0
        if meta.loads:
            slots = torch.tensor([s for s, _ in meta.loads])
            blocks = torch.tensor([b for _, b in meta.loads], device=dev)
            for cache, pool in zip(self.kv_caches, self.pool):
                cache.index_copy_(1, blocks, pool.index_select(1, slots).to(dev, non_blocking=True))
        for h, block_id in meta.disk_loads:
            data = self._disk.read(h, self.block_shape, self.kv_caches[0].dtype)
            if data is None:  # checked by the scheduler this step: deleted or replaced since, by another engine
                self.failed.append(block_id)
                continue
            for layer, cache in enumerate(self.kv_caches):
                cache[:, block_id].copy_(data[layer])
        self.load_seconds += time.perf_counter() - t1

    def after_forward(self, meta: KVConnectorMetadata) -> None:
        """Write the blocks this step filled to disk."""
        t0 = time.perf_counter()
        for block_id, h in meta.disk_saves:
            self._disk.write(h, torch.stack([c[:, block_id] for c in self.kv_caches]).cpu())
        self.save_seconds += time.perf_counter() - t0

    def take_times(self) -> tuple[float, float]:
        out = (self.save_seconds, self.load_seconds)
        self.save_seconds = self.load_seconds = 0.0
        return out
