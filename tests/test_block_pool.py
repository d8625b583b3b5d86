"""Property tests: random allocate / append / free / abort sequences keep the block-pool invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_groups import KVGroups
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

BLOCK = 4


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1000), max_tokens=1000)


def test_free_queue_pops_in_lru_order_and_removes_from_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 4, 2]
    assert q.num_free == 4


def test_freed_cached_block_is_reused_by_prefix_hit_then_evicted_last():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    a = _req("a", list(range(9)))  # 2 full blocks + 1 token
    assert kv.allocate_slots(a, a.num_tokens) is not None
    a_blocks = kv.get_block_ids("a")
    a.num_computed_tokens = a.num_tokens
    kv.free(a)
    b = _req("b", list(range(8)) + [99, 98])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [h.block_id for h in hits[0]] == a_blocks[:2]
    kv.allocate_slots(b, b.num_tokens - n, hits, n)
    kv.record_lookup(b, n)  # the scheduler records the lookup of a request it admits
    b.num_computed_tokens = b.num_tokens
    assert (kv.stats.queries, kv.stats.hits) == (10, 8)
    kv.check_invariants()
    kv.free(b)
    kv.check_invariants()
    assert kv.pool.num_free_blocks == 4


def test_freed_empty_blocks_are_handed_out_again_first():
    """A freed block holding nothing cached is the next one handed out, before blocks never used and before cached
    ones: the cache's resident pages stay those of the most blocks ever in use at once."""
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_caching=False)
    seen: set[int] = set()
    for i in range(20):  # one request at a time, each of 3 blocks: the same 3 blocks every time
        r = _req(f"r{i}", list(range(100 * i, 100 * i + 10)))
        assert kv.allocate_slots(r, r.num_tokens) is not None
        seen.update(kv.get_block_ids(r.request_id))
        kv.free(r)
    assert len(seen) == 3
    kv.check_invariants()

    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    a = _req("a", list(range(9)))  # 2 full blocks (cached when freed) + 1 partial (empty when freed)
    kv.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    full, partial = kv.get_block_ids("a")[:2], kv.get_block_ids("a")[2]
    kv.free(a)
    queue = [b.block_id for b in kv.pool.free_queue]
    assert queue[0] == partial and sorted(queue[-2:]) == full  # a request frees its last block first
    kv.check_invariants()


def test_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    a = _req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.free(a)
    again = _req("again", list(range(8)))
    _, n = kv.get_computed_blocks(again)
    assert n == 4  # the second block is cached too, but its last token must run for logits


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=BLOCK)
    a = _req("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is None
    kv.check_invariants()
    assert kv.pool.num_free_blocks == 2 and "a" not in kv.req_blocks


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "step", "free", "abort"]), st.integers(0, 7), st.integers(1, 40), st.integers(0, 3)
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    ops=ops,
    num_blocks=st.integers(1, 24),
    caching=st.booleans(),
    windows=st.sampled_from([None, (None, 6, 6), (None, None, 9, 5, 9)]),
)  # one table; local groups
def test_random_operation_sequences_keep_invariants_and_return_every_block(ops, num_blocks, caching, windows):
    groups = KVGroups.plan(list(windows)) if windows else None
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK, enable_caching=caching, groups=groups)
    live: dict[str, Request] = {}
    counter = 0
    for op, slot, length, prefix in ops:
        if op == "add":
            counter += 1
            # a few shared prefixes so the cache gets hits
            tokens = [prefix] * (length // 2) + [counter * 1000 + i for i in range(length - length // 2)]
            req = _req(f"r{counter}", tokens)
            hits, n_hit = kv.get_computed_blocks(req)
            n_new = min(req.num_tokens - n_hit, 1 + slot * 3)
            if kv.allocate_slots(req, n_new, hits, n_hit) is not None:
                req.num_computed_tokens = n_hit + n_new
                live[req.request_id] = req
        elif op == "step" and live:
            req = list(live.values())[slot % len(live)]
            if req.num_computed_tokens == req.num_tokens:
                req.append_output_token(7 + slot)  # a decode: one new known token
            n = min(req.num_tokens - req.num_computed_tokens, 1 + slot)
            if kv.allocate_slots(req, n) is not None:
                req.num_computed_tokens += n
        elif op in ("free", "abort") and live:
            req = live.pop(list(live)[slot % len(live)])
            kv.free(req)
        kv.check_invariants()
        held = {b.block_id for g in kv.groups for bl in g.req_blocks.values() for b in bl if b is not None}
        assert kv.pool.num_free_blocks + len(held) == num_blocks
        for g in kv.groups[1:]:  # a local group holds its window and a step's tokens (at most 1 + 7 * 3), no more
            for bl in g.req_blocks.values():
                assert sum(b is not None for b in bl) <= -(-(g.window + 22) // BLOCK) + 1
    for req in list(live.values()):
        kv.free(req)
    kv.check_invariants()
    assert kv.pool.num_free_blocks == num_blocks
    assert all(g.req_blocks == {} for g in kv.groups)


def test_local_groups_free_the_blocks_behind_their_window_and_still_hit_the_prefix_cache():
    """Group 0 (full attention) keeps every block; a local group (window 6, blocks of 4) frees each block once
    no later token attends to it. The freed blocks stay prefix-cached: a second request with the same prompt
    finds, in the local group, just the blocks its window needs."""
    groups = KVGroups.plan([None, 6])
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK, groups=groups)
    a = _req("a", list(range(20)))
    assert [len(g) for g in kv.allocate_slots(a, 20)] == [5, 5]  # a prompt step writes every block of each
    a.num_computed_tokens = 20
    for _ in range(8):  # decodes: token 20 attends to 15..20, token 27 to 22..27
        a.append_output_token(1)
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
        kv.check_invariants()
    full, local = kv.groups[0].req_blocks["a"], kv.groups[1].req_blocks["a"]
    assert len(full) == len(local) == 7 and None not in full
    # the last allocation (for token 27) freed what token 27's window (22..27) does not reach: blocks 0..4
    assert local[:5] == [None] * 5 and None not in local[5:]
    assert kv.pool.num_free_blocks == 32 - 7 - 2
    assert kv.get_group_block_ids("a")[0][:5] == [0] * 5
    b = _req("b", list(range(20)) + [5, 5])
    hits, n = kv.get_computed_blocks(b)
    assert n == 20 and [len(h) for h in hits] == [5, 5]
    # token 20 attends to 15..20: block 3 (12..15) and block 4 of the local group, the rest not needed
    assert hits[1][:3] == [None] * 3 and hits[1][3].block_hash == b.block_hashes[3] + kv.groups[1].tag
    assert kv.allocate_slots(b, 2, hits, n) is not None
    kv.check_invariants()
    kv.free(a)
    kv.free(b)
    kv.check_invariants()
    assert kv.pool.num_free_blocks == 32


def test_a_local_group_hit_needs_the_whole_window():
    """Where a local group's window blocks were evicted, the hit shortens to a prefix whose window is there."""
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK, groups=KVGroups.plan([None, 6]))
    a = _req("a", list(range(17)))
    kv.allocate_slots(a, 17)
    a.num_computed_tokens = 17
    kv.free(a)
    b = _req("b", list(range(17)))
    kv.update_block_hashes(b)
    kv.pool.uncache(kv.pool.get_cached_block(b.block_hashes[3] + kv.groups[1].tag))
    hits, n = kv.get_computed_blocks(b)
    # 4 blocks cached in group 0; token 16's window (11..16) needs local blocks 2 and 3: 3 is gone. A prefix of
    # 3 blocks: token 12's window (7..12) needs local blocks 1 and 2, both there
    assert n == 12 and [len(h) for h in hits] == [3, 3] and hits[1][0] is None


def test_block_pool_refuses_to_hand_out_more_than_it_has():
    pool = BlockPool(3)
    pool.get_new_blocks(3)
    try:
        pool.get_new_blocks(1)
    except ValueError as e:
        assert "only 0 free" in str(e)
    else:
        raise AssertionError("expected ValueError")
