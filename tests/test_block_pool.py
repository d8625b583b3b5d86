"""Property tests: random allocate / append / free / abort sequences keep the block-pool invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from pagedllm.core.kv_cache_manager import KVCacheManager
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
    assert n == 8 and [h.block_id for h in hits] == a_blocks[:2]
    kv.allocate_slots(b, b.num_tokens - n, hits, n)
    kv.record_lookup(b, n)  # the scheduler records the lookup of a request it admits
    b.num_computed_tokens = b.num_tokens
    assert (kv.stats.queries, kv.stats.hits) == (10, 8)
    kv.check_invariants()
    kv.free(b)
    kv.check_invariants()
    assert kv.pool.num_free_blocks == 4


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
    st.tuples(st.sampled_from(["add", "step", "free", "abort"]), st.integers(0, 7), st.integers(1, 40),
              st.integers(0, 3)),
    min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 24), caching=st.booleans())
def test_random_operation_sequences_keep_invariants_and_return_every_block(ops, num_blocks, caching):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK, enable_caching=caching)
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
        held = sum(len(b) for b in kv.req_blocks.values())
        assert kv.pool.num_free_blocks + len({b.block_id for bl in kv.req_blocks.values() for b in bl}) == num_blocks
        assert held >= 0
    for req in list(live.values()):
        kv.free(req)
    kv.check_invariants()
    assert kv.pool.num_free_blocks == num_blocks
    assert kv.req_blocks == {}


def test_block_pool_refuses_to_hand_out_more_than_it_has():
    pool = BlockPool(3)
    pool.get_new_blocks(3)
    try:
        pool.get_new_blocks(1)
    except ValueError as e:
        assert "only 0 free" in str(e)
    else:
        raise AssertionError("expected ValueError")
