"""The pool of fixed-size KV cache blocks, with ref counts and an LRU free queue.

Every block is in exactly one of three states::

    in use        ref_cnt > 0, not in the free queue (hash set iff the block is full and cached)
    free, cached  ref_cnt == 0, in the free queue, hash set: reusable by a prefix-cache hit
    free, empty   ref_cnt == 0, in the free queue, no hash

The free queue is ordered by eviction priority: allocation pops from the head.
A freed block that is cached is appended at the tail (least recently freed
cached blocks are evicted first), so it survives as long as possible; a freed
empty block goes to the head, to be the next one handed out. Empty blocks are
thus reused most recently freed first: their pages are already resident, and
the cache's resident memory stays that of the most blocks ever in use at once,
not of every block the pool has (its pages are only faulted in when first
written). A prefix-cache hit on a free block takes it out of the middle of the
queue in O(1) (doubly-linked list).

Invariants (checked by :meth:`BlockPool.check_invariants`):
  * ref counts are never negative;
  * a block is in the free queue iff its ref count is 0;
  * every hash in ``cached`` maps to a block carrying that hash, and every hashed block is in ``cached``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly-linked list of free blocks with O(1) pop-left, append and remove."""

    def __init__(self, blocks: Sequence[KVCacheBlock]):
        self.num_free = len(blocks)
        self._head = KVCacheBlock(-1)  # sentinels: no None checks in the hot path
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free, block.prev_free = block, prev
            prev = block
        prev.next_free, self._tail.prev_free = self._tail, prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        assert block is not None  # the head sentinel always links to a block or the tail
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None  # a queued block sits between two blocks or sentinels
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self._head.next_free
        assert first is not None  # the head sentinel always links to a block or the tail
        self._head.next_free, block.prev_free = block, self._head
        block.next_free, first.prev_free = first, block
        self.num_free += 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None  # the tail sentinel always links back to a block or the head
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Hash of one full block, chained from its parent's so equal hashes mean equal prefixes."""
    h = hashlib.sha256(parent_hash or b"root")
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    h.update(extra)
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 0:  # 0: an encoder pooling model's, which keeps no KV
            raise ValueError(f"the KV cache cannot have {num_blocks} blocks")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        # called with (block id, hash) when a cached block is about to be reused (a KV connector saves it)
        self.on_evict: Callable[[int, bytes], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0  # an encoder's: none

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the head of the free queue, evicting their cached contents."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None and self.on_evict is not None:
                self.on_evict(block.block_id, block.block_hash)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (reviving free ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block. A block reaching 0 goes to the queue's tail (in this order) if it is
        cached, else to its head, to be handed out next (its pages are resident)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    self._evict(block)
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full block under its hash. An identical block already cached keeps the entry."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # two requests computed the same block concurrently; the first one stays canonical
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def uncache(self, block: KVCacheBlock) -> None:
        """Forget a block's hash (its contents are not what the hash says): no prefix hit will find it."""
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True

    def check_invariants(self) -> None:
        in_queue = set()
        for block in self.free_queue:
            assert block.block_id not in in_queue, f"{block} twice in the free queue"
            in_queue.add(block.block_id)
        assert len(in_queue) == self.free_queue.num_free, "free count out of sync"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"negative ref count: {block}"
            assert (block.ref_cnt == 0) == (block.block_id in in_queue), f"free queue out of sync: {block}"
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"hashed block not in cache map: {block}"
        for h, block in self.cached.items():
            assert block.block_hash == h, f"cache map entry points at wrong block: {block}"
