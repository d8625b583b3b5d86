"""Maps requests to KV cache blocks: allocation, prefix-cache lookup, freeing.

A request's blocks, left to right::

    | cached prefix (shared, ref >= 1) | computed by this request | allocated for this step | (none yet)
    ^ 0                                ^ num_cached_tokens         ^ num_computed_tokens      ^ + num_new_tokens

Full blocks are hashed (chained from the parent block's hash) and registered in
the block pool as soon as their tokens are scheduled, so a second request in the
same step can already share them: attention runs layer by layer and writes every
new token's K/V before it reads any, so the sharer reads finished data.

With sliding-window layers (:mod:`pagedllm.core.kv_groups`) a request has one such list
per group of layers, all from the one pool. In a local group the blocks that fall behind
the window are freed as the request goes on (their entries become None; the runner's
table keeps a stale id there that attention never reads), and they stay in the prefix
cache until evicted: a prefix hit needs, in each local group, only the blocks of the
window before the first token it computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from pagedllm.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from pagedllm.core.kv_groups import KVGroups, cdiv
from pagedllm.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found

    def reset(self) -> PrefixCacheStats:
        old = PrefixCacheStats(self.queries, self.hits)
        self.queries = self.hits = 0
        return old


class _Group:
    """One group's block lists: ``window`` None for full attention; ``tag`` sets its hashes apart (its blocks
    hold other layers' K/V than group 0's for the same tokens)."""

    def __init__(self, index: int, window: int | None):
        self.window = window
        self.tag = b"" if index == 0 else b"group" + index.to_bytes(2, "little")
        self.req_blocks: dict[str, list[KVCacheBlock | None]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many leading blocks of a request are registered
        self.num_freed: dict[str, int] = {}  # local groups: leading blocks already freed (None)

    def first_needed(self, num_tokens: int, block_size: int) -> int:
        """The first block a token at position ``num_tokens`` attends to."""
        return 0 if self.window is None else max(0, num_tokens - self.window + 1) // block_size


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, groups: KVGroups | None = None):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.groups = [_Group(i, w) for i, w in enumerate(groups.windows if groups is not None else (None,))]
        # group 0's lists: every consumer that knows of one table (KV connectors, the dashboard) reads these.
        # Group 0 is full attention: it frees nothing behind a window, so its lists never hold None.
        self.req_blocks = cast(dict[str, list[KVCacheBlock]], self.groups[0].req_blocks)
        # blocks a finished request left behind for someone else to read (a KV connector's producer keeps a
        # prefill's blocks until its consumer has pulled them): key -> blocks, one reference each
        self.holds: dict[str, list[KVCacheBlock]] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its known tokens."""
        if not self.enable_caching:
            return
        bs, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            # an adapter's KV differs from the base model's for the same tokens: its id is in every hash
            extra = request.lora_int_id.to_bytes(8, "little") if request.lora_int_id else b""
            # an image's placeholders are the same token whatever the image: the hash of each image a block
            # holds part of, and where it starts relative to the block, tell them apart
            for f in request.mm_features:
                if f.offset < (i + 1) * bs and f.end > i * bs:
                    extra += f.identifier.encode() + (f.offset - i * bs).to_bytes(8, "little", signed=True)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs], extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock | None]], int]:
        """Longest cached prefix of the request, as (each group's blocks, number of tokens)."""
        none: list[list[KVCacheBlock | None]] = [[] for _ in self.groups]
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return none, 0  # prompt logprobs need every prompt position computed
        self.update_block_hashes(request)
        # keep at least one token uncached: logits need a forward pass
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock | None] = []
        for h in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        for k in range(len(hits), 0, -1):  # the longest prefix every local group holds its window of
            local = [self._window_hits(g, request, k) for g in self.groups[1:]]
            found = [blocks for blocks in local if blocks is not None]
            if len(found) == len(local):
                return [hits[:k], *found], k * self.block_size
        return none, 0

    def _window_hits(self, g: _Group, request: Request, k: int) -> list[KVCacheBlock | None] | None:
        """Group g's cached blocks for a prefix of k blocks (None behind the window of token k * block_size),
        or None where one is missing."""
        first = g.first_needed(k * self.block_size, self.block_size)
        out: list[KVCacheBlock | None] = [None] * first
        for h in request.block_hashes[first:k]:
            block = self.pool.get_cached_block(h + g.tag)
            if block is None:
                return None
            out.append(block)
        return out

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count an admitted request's prefix-cache lookup once (a request the scheduler looks up but cannot admit
        yet is looked up again next step, and counting each try would weigh queued requests more)."""
        if self.enable_caching and request.sampling_params.prompt_logprobs is None:
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[list[KVCacheBlock | None]] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[list[KVCacheBlock]] | None:
        """Make room for ``num_new_tokens`` more tokens (and ``num_lookahead_tokens`` slots after them, which a
        speculative proposer writes its own KV into); returns each group's new blocks, or None (and no
        change but local groups' freeing) if blocks run short.

        Only the request's known tokens are ever hashed: slots holding drafts (computed, then maybe rejected)
        or lookahead are not registered in the prefix cache until real tokens fill them."""
        rid = request.request_id
        hits = new_computed_blocks or [[] for _ in self.groups]
        for g in self.groups[1:]:  # what no token from here on attends to
            self._free_behind_window(g, rid, request.num_computed_tokens)
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total_tokens = num_computed + num_new_tokens
        want = cdiv(total_tokens + num_lookahead_tokens, self.block_size)
        required = [max(want - len(g.req_blocks.get(rid, ())) - len(h), 0) for g, h in zip(self.groups, hits)]
        # cached hits that sit in the free queue stop being free once we take them
        num_revived = sum(1 for h in hits for b in h if b is not None and b.ref_cnt == 0)
        if sum(required) + num_revived > self.pool.num_free_blocks:
            return None
        out = []
        for g, h, n in zip(self.groups, hits, required):
            blocks = g.req_blocks.setdefault(rid, [])
            if not blocks:  # a local group's hits start with the blocks behind its window: None
                g.num_freed[rid] = next((i for i, b in enumerate(h) if b is not None), len(h))
            self.pool.touch(b for b in h if b is not None)
            blocks.extend(h)
            new_blocks = self.pool.get_new_blocks(n) if n else []
            blocks.extend(new_blocks)
            self._cache_full_blocks(g, request, blocks, total_tokens)
            out.append(new_blocks)
        return out

    def _free_behind_window(self, g: _Group, rid: str, num_computed: int) -> None:
        blocks = g.req_blocks.get(rid)
        if not blocks:
            return
        end = min(g.first_needed(num_computed, self.block_size), len(blocks))
        start = g.num_freed.get(rid, 0)
        if end <= start:
            return
        freed = [b for b in blocks[start:end] if b is not None]
        blocks[start:end] = [None] * (end - start)
        g.num_freed[rid] = end
        self.pool.free_blocks(reversed(freed))

    def _cache_full_blocks(
        self, g: _Group, request: Request, blocks: list[KVCacheBlock | None], num_tokens: int
    ) -> None:
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        start = g.num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            block = blocks[i]
            if block is not None:
                self.pool.cache_block(block, request.block_hashes[i] + g.tag)
        g.num_cached_blocks[request.request_id] = max(start, end)

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]] | None:
        """Give ``child`` the parent's prompt blocks: shared by reference up to the block holding the
        last prompt token, which is copied (copy-on-write) so the child can write into it.

        Returns the copies to make, (source, destination) block ids (one a group), or None if blocks run short.
        """
        k = (parent.num_prompt_tokens - 1) // self.block_size
        if self.pool.num_free_blocks < len(self.groups):
            return None
        copies = []
        for g in self.groups:
            blocks = g.req_blocks[parent.request_id]
            shared = blocks[:k]
            self.pool.touch(b for b in shared if b is not None)
            new = self.pool.get_new_blocks(1)[0]
            g.req_blocks[child.request_id] = shared + [new]
            g.num_cached_blocks[child.request_id] = min(k, g.num_cached_blocks.get(parent.request_id, 0))
            if parent.request_id in g.num_freed:
                g.num_freed[child.request_id] = min(k, g.num_freed[parent.request_id])
            last = blocks[k]
            assert last is not None  # it holds the last prompt token: inside every window
            copies.append((last.block_id, new.block_id))
        return copies

    def free(self, request: Request) -> None:
        """Release all blocks of a request. Tail blocks are freed first so they are evicted first."""
        for g in self.groups:
            blocks = g.req_blocks.pop(request.request_id, [])
            g.num_cached_blocks.pop(request.request_id, None)
            g.num_freed.pop(request.request_id, None)
            self.pool.free_blocks(b for b in reversed(blocks) if b is not None)

    def hold(self, key: str, blocks: list[KVCacheBlock]) -> None:
        """Keep ``blocks`` (a request's, before it is freed) until :meth:`release_hold`: a reference each."""
        assert key not in self.holds, f"{key} is held twice"
        self.pool.touch(blocks)
        self.holds[key] = blocks

    def release_hold(self, key: str) -> None:
        self.pool.free_blocks(reversed(self.holds.pop(key)))

    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's block ids of a request."""
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The local groups' block ids of a request; 0 stands where a block was freed (never read)."""
        return [[0 if b is None else b.block_id for b in g.req_blocks.get(request_id, [])] for g in self.groups[1:]]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        held: dict[int, int] = {}
        for g in self.groups:
            for rid, blocks in g.req_blocks.items():
                assert rid in self.req_blocks, f"{rid} holds blocks in a local group only"
                assert all(b is None for b in blocks[: g.num_freed.get(rid, 0)]), f"{rid}: a freed block is held"
                for b in blocks:
                    if b is not None:
                        held[b.block_id] = held.get(b.block_id, 0) + 1
        for kept in self.holds.values():
            for k in kept:
                held[k.block_id] = held.get(k.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == held.get(block.block_id, 0), f"ref count != holders for {block}"
