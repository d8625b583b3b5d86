"""Maps requests to KV cache blocks: allocation, prefix-cache lookup, freeing.

A request's blocks, left to right::

    | cached prefix (shared, ref >= 1) | computed by this request | allocated for this step | (none yet)
    ^ 0                                ^ num_cached_tokens         ^ num_computed_tokens      ^ + num_new_tokens

Full blocks are hashed (chained from the parent block's hash) and registered in
the block pool as soon as their tokens are scheduled, so a second request in the
same step can already share them: attention runs layer by layer and writes every
new token's K/V before it reads any, so the sharer reads finished data.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from pagedllm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found

    def reset(self) -> "PrefixCacheStats":
        old = PrefixCacheStats(self.queries, self.hits)
        self.queries = self.hits = 0
        return old


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many leading blocks of a request are registered
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
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs], extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, as (blocks, number of tokens)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed
        self.update_block_hashes(request)
        # keep at least one token uncached: logits need a forward pass
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count an admitted request's prefix-cache lookup once (a request the scheduler looks up but cannot admit
        yet is looked up again next step, and counting each try would weigh queued requests more)."""
        if self.enable_caching and request.sampling_params.prompt_logprobs is None:
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_new_computed_tokens: int = 0,
                       num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens (and ``num_lookahead_tokens`` slots after them, which a
        speculative proposer writes its own KV into); None (and no change) if blocks run short.

        Only the request's known tokens are ever hashed: slots holding drafts (computed, then maybe rejected)
        or lookahead are not registered in the prefix cache until real tokens fill them."""
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total_tokens = num_computed + num_new_tokens
        num_required = (cdiv(total_tokens + num_lookahead_tokens, self.block_size) - len(blocks)
                        - len(new_computed_blocks))
        # cached hits that sit in the free queue stop being free once we take them
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_required, 0) + num_revived > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_required) if num_required > 0 else []
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, blocks, total_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, end)

    def fork(self, parent: Request, child: Request) -> KVCacheBlock | None:
        """Give ``child`` the parent's prompt blocks: shared by reference up to the block holding the
        last prompt token, which is copied (copy-on-write) so the child can write into it.

        Returns the child's new block (the copy's destination), or None if no block is free.
        """
        blocks = self.req_blocks[parent.request_id]
        k = (parent.num_prompt_tokens - 1) // self.block_size
        if self.pool.num_free_blocks < 1:
            return None
        shared = blocks[:k]
        self.pool.touch(shared)
        new = self.pool.get_new_blocks(1)[0]
        self.req_blocks[child.request_id] = shared + [new]
        self.num_cached_blocks[child.request_id] = min(k, self.num_cached_blocks.get(parent.request_id, 0))
        return new

    def free(self, request: Request) -> None:
        """Release all blocks of a request. Tail blocks are freed first so they are evicted first."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        held: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == held.get(block.block_id, 0), f"ref count != holders for {block}"
