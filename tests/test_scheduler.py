"""Scheduler + KV cache manager against a fake model that reads its context back from the paged cache.

The fake runner writes each computed token id into its (block, offset) slot and
derives the next token from the context it reads back through the block table.
A wrong block table, a prefix-cache hit on the wrong block, a lost chunk or a
bad recompute after preemption all change the outputs.
"""

from __future__ import annotations

import random
import zlib

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.runner_output import ModelRunnerOutput

BS = 4


class FakeRunner:
    def __init__(self, num_blocks: int):
        self.slots: dict[int, int] = {}  # flat slot -> token id written there
        self.state: dict[str, dict] = {}
        self.num_computed_tokens_total = 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.state.pop(rid, None)
        for new in so.new_reqs:
            self.state[new.req_id] = {
                "tokens": new.prompt_token_ids + new.output_token_ids,
                "blocks": list(new.block_ids),
                "computed": new.num_computed_tokens,
            }
        for c in so.cached_reqs:
            st = self.state[c.req_id]
            st["blocks"] += c.new_block_ids
            assert st["computed"] == c.num_computed_tokens
        sampled = {}
        # write every new token first (as the real backend does), then read
        for rid, n in so.num_scheduled_tokens.items():
            st = self.state[rid]
            for pos in range(st["computed"], st["computed"] + n):
                self.slots[st["blocks"][pos // BS] * BS + pos % BS] = st["tokens"][pos]
            self.num_computed_tokens_total += n
        for rid, n in so.num_scheduled_tokens.items():
            st = self.state[rid]
            st["computed"] += n
            if st["computed"] == len(st["tokens"]):
                ctx = [self.slots[st["blocks"][p // BS] * BS + p % BS] for p in range(st["computed"])]
                tok = zlib.crc32(repr(ctx).encode()) % 50 + 10
                st["tokens"].append(tok)
                sampled[rid] = [tok]
        return ModelRunnerOutput(sampled)


def run(
    prompts,
    *,
    num_blocks=64,
    budget=64,
    chunked=True,
    caching=True,
    max_seqs=16,
    max_tokens=12,
    policy="fcfs",
    priorities=None,
    max_model_len=256,
    check=True,
):
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            enable_chunked_prefill=chunked,
            scheduling_policy=policy,
        ),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        num_blocks,
        max_model_len,
    )
    runner = FakeRunner(num_blocks)
    reqs = []
    for i, p in enumerate(prompts):
        r = Request(
            f"r{i}",
            list(p),
            SamplingParams(max_tokens=max_tokens),
            max_tokens,
            priority=(priorities or [0] * len(prompts))[i],
        )
        r.sampling_params.bind_eos(frozenset())
        sched.add_request(r)
        reqs.append(r)
    steps = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        assert so.total_num_scheduled_tokens <= budget
        assert len(sched.running) <= max_seqs
        sched.update_from_output(so, runner.execute(so))
        if check:
            sched.check_invariants()
        steps += 1
        assert steps < 10_000, "no progress: scheduler deadlocked"
    sched.kv.check_invariants()
    assert sched.kv.pool.num_free_blocks == num_blocks, "blocks leaked"
    return [r.output_token_ids for r in reqs], sched, runner, reqs


def _prompts(seed=0, n=10, shared_prefix=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(100) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(100) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def test_chunked_prefill_does_not_change_outputs():
    prompts = _prompts()
    ref, *_ = run(prompts, budget=1000, chunked=False)
    for budget in (1, 3, 7, 32):
        out, *_ = run(prompts, budget=budget)
        assert out == ref, f"budget {budget}"


def test_unchunked_prompt_waits_for_a_step_with_enough_budget():
    out, *_ = run([[1] * 30, [2] * 30], budget=40, chunked=False)
    assert all(len(o) == 12 for o in out)


def test_prefix_cache_hit_does_not_change_output_and_skips_work():
    prompts = _prompts(shared_prefix=24)
    ref, _, runner_off, _ = run(prompts, caching=False)
    out, _, runner_on, reqs = run(prompts, caching=True)
    assert out == ref
    assert sum(r.num_cached_tokens for r in reqs) > 0
    assert runner_on.num_computed_tokens_total < runner_off.num_computed_tokens_total


def test_prefix_cache_stats_count_each_admitted_prompt_once():
    # unchunked 30-token prompts under a 40-token budget: each waits a step or more, looked up every time
    prompts = [[7] * 24 + [i] * 6 for i in range(6)]
    _, sched, _, reqs = run(prompts, budget=40, chunked=False)
    stats = sched.make_stats().prefix_cache
    assert stats.queries == sum(len(p) for p in prompts)
    assert stats.hits == sum(r.num_cached_tokens for r in reqs) == 5 * 24


def test_preemption_under_tiny_cache_finishes_every_request():
    prompts = _prompts(n=12)
    ref, *_ = run(prompts, num_blocks=200)
    for caching in (True, False):
        out, sched, _, reqs = run(prompts, num_blocks=14, caching=caching, max_model_len=14 * BS)
        assert out == ref
        assert sched.num_preemptions > 0
        assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)


def test_priority_policy_preempts_the_least_important_request():
    prompts = [[1] * 20, [2] * 20, [3] * 20]
    _, sched, _, reqs = run(
        prompts, num_blocks=16, policy="priority", priorities=[5, 0, 9], max_tokens=30, max_model_len=64
    )
    assert sched.num_preemptions > 0
    # the most important request (priority 0) is never the victim
    assert reqs[1].num_preemptions == 0
    assert reqs[2].num_preemptions >= reqs[0].num_preemptions


def test_priority_policy_admits_lower_values_first():
    prompts = [[1] * 8, [2] * 8, [3] * 8]
    _, _, _, reqs = run(prompts, max_seqs=1, policy="priority", priorities=[3, 1, 2])
    order = sorted(reqs, key=lambda r: r.first_scheduled_time)
    assert [r.request_id for r in order] == ["r1", "r2", "r0"]


def test_max_num_seqs_caps_the_running_set():
    out, *_ = run(_prompts(n=9), max_seqs=2)
    assert all(len(o) == 12 for o in out)


def test_abort_frees_blocks_of_running_and_waiting_requests():
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8), CacheConfig(block_size=BS), 16, 64)
    reqs = [Request(f"r{i}", [i] * 10, SamplingParams(max_tokens=5), 5) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner(16)
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    aborted = sched.abort_requests(["r0", "r2", "nope"])
    assert [r.request_id for r in aborted] == ["r0", "r2"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted)
    sched.check_invariants()
    while sched.has_unfinished_requests():
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
    assert sched.kv.pool.num_free_blocks == 16


def test_aborted_waiting_requests_leave_the_queue_without_a_scan():
    """Aborting queued requests is O(1) each: they leave the count at once and are never scheduled."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), CacheConfig(block_size=BS), 64, 64)
    leader = Request("p0", [1] * 6, SamplingParams(max_tokens=3), 3)
    leader.pending_children = [Request(f"p{i}", [1] * 6, SamplingParams(max_tokens=3), 3, index=i) for i in range(1, 4)]
    queued = [Request(f"q{i}", [i] * 6, SamplingParams(max_tokens=3), 3) for i in range(500)]
    for r in [leader, *queued]:
        sched.add_request(r)
    assert sched.num_waiting_requests() == 1 + 3 + 500  # unforked n>1 siblings count as waiting
    sched.abort_requests([f"q{i}" for i in range(0, 500, 2)] + ["p0", "p1", "p2", "p3"])
    assert sched.num_waiting_requests() == 250 and len(sched.waiting) == 250
    runner, scheduled = FakeRunner(64), set()
    while sched.has_unfinished_requests():
        so = sched.schedule()
        scheduled |= set(so.num_scheduled_tokens)
        sched.update_from_output(so, runner.execute(so))
        sched.check_invariants()
    assert scheduled == {f"q{i}" for i in range(1, 500, 2)}
    assert sched.num_waiting_requests() == 0 and sched.kv.pool.num_free_blocks == 64


def test_fcfs_serves_request_groups_in_turn():
    """A batch of prompts (one group) queued first does not hold back a small request queued after it."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), CacheConfig(block_size=BS), 64, 64)
    batch = [Request(f"big-{i}", [i + 1] * 6, SamplingParams(max_tokens=2), 2, group="big") for i in range(20)]
    small = Request("small", [7] * 6, SamplingParams(max_tokens=2), 2, group="small")
    for r in [*batch, small]:
        sched.add_request(r)
    runner, admitted = FakeRunner(64), []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        admitted += [n.req_id for n in so.new_reqs]
        sched.update_from_output(so, runner.execute(so))
        sched.check_invariants()
    assert admitted.index("small") == 1  # right after the batch's first prompt, not after all 20
    assert [a for a in admitted if a != "small"] == [f"big-{i}" for i in range(20)]  # a group keeps its order


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_aborted_waiting_requests_do_not_pile_up_behind_a_blocked_head(policy):
    """Lazy removal still lets go of removed requests: the queue is compacted as they accumulate."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, scheduling_policy=policy),
        CacheConfig(block_size=BS),
        64,
        64,
    )
    head = Request("head", [1] * 6, SamplingParams(max_tokens=3), 3)
    sched.add_request(head)
    for i in range(2000):  # a client that queues and vanishes, over and over, behind a head that never moves
        sched.add_request(Request(f"q{i}", [2] * 6, SamplingParams(max_tokens=3), 3))
        sched.abort_requests([f"q{i}"])
    queue = sched.waiting
    entries = sum(map(len, queue._lanes.values())) if queue.fcfs else len(queue._heap)
    assert len(queue) == 1 and entries <= 1 + 64 + 1
    assert sched.waiting.peek() is head


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_match_the_unconstrained_run(seed):
    rng = random.Random(seed)
    prompts = _prompts(seed=seed, n=rng.randint(2, 14), shared_prefix=rng.choice([0, 5, 16]))
    ref, *_ = run(prompts, num_blocks=400, budget=1000, caching=False, max_model_len=14 * BS)
    out, *_ = run(
        prompts,
        num_blocks=rng.randint(14, 40),
        budget=rng.randint(1, 48),
        caching=rng.random() < 0.5,
        max_seqs=rng.randint(1, 8),
        max_model_len=14 * BS,
    )
    assert out == ref


# -- images: the scheduler's record of the runner's encoder cache ------------------------------------------------


class FakeEncoderRunner:
    """Mirrors the encoder cache as the model runner keeps it, and checks every chunk finds the images it reads."""

    def __init__(self) -> None:
        self.cache: set[str] = set()
        self.features: dict[str, list] = {}
        self.computed: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self.encoded = 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.features.pop(rid, None)
        for new in so.new_reqs:
            self.features[new.req_id] = new.mm_features
            self.computed[new.req_id] = new.num_computed_tokens
            self.tokens[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
        for c in so.cached_reqs:
            assert self.computed[c.req_id] == c.num_computed_tokens
        for h in so.freed_encoder_inputs:  # first the evictions, then the step's encodings
            self.cache.remove(h)
        for rid, indices in so.scheduled_encoder_inputs.items():
            for k in indices:
                self.cache.add(self.features[rid][k].identifier)
                self.encoded += 1
        sampled = {}
        for rid, n in so.num_scheduled_tokens.items():
            start = self.computed[rid]
            for f in self.features[rid]:
                if f.offset < start + n and f.end > start:
                    assert f.identifier in self.cache, f"{rid} reads {f.identifier} at {start}..{start + n}: not held"
            self.computed[rid] += n
            if self.computed[rid] == self.tokens[rid]:
                sampled[rid] = [7]
                self.tokens[rid] += 1
        return ModelRunnerOutput(sampled)


def _image_request(rid: str, parts: list, max_tokens: int = 3) -> Request:
    """``parts``: text lengths (int) and images (identifier, length), in prompt order."""
    from pagedllm.multimodal import MultiModalFeature

    ids: list[int] = []
    features = []
    for p in parts:
        if isinstance(p, int):
            ids += [(len(ids) * 7 + len(rid)) % 50 + 1 for _ in range(p)]
        else:
            features.append(MultiModalFeature("image", p[0], len(ids), p[1], None))
            ids += [999] * p[1]
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens, mm_features=features)


def _run_images(
    requests: list[Request], budget: int, cache: int, batched: int, num_blocks: int = 400
) -> FakeEncoderRunner:
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=batched, enable_chunked_prefill=True),
        CacheConfig(block_size=BS, enable_prefix_caching=True),
        num_blocks=num_blocks,
        max_model_len=4096,
        encoder=(budget, cache),
    )
    runner = FakeEncoderRunner()
    pending = list(requests)
    for step in range(5000):
        if pending and step % 3 == 0:  # arrivals spread over the run
            sched.add_request(pending.pop(0))
        if not pending and not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
        sched.check_invariants()
    else:
        raise AssertionError("the requests never finished: a request waits on encoder cache room forever")
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks
    enc = sched.encoder_cache
    assert enc is not None and all(not readers for readers in enc.readers.values())  # nobody holds an image
    return runner


def test_a_chunk_that_reads_a_cached_image_and_encodes_another_fits_the_encoder_cache():
    """A cache of one image: the second prompt reads X (cached from the first) and reaches Y in the same chunk;
    Y waits for the next step, when X is behind it and can be evicted."""
    runner = _run_images(
        [_image_request("a", [3, ("X", 8), 2]), _image_request("b", [5, ("X", 8), 1, ("Y", 8), 2])],
        budget=8,
        cache=8,
        batched=64,
    )
    assert runner.encoded == 2  # X once (b reads it from the cache), then Y in X's place


def test_the_same_image_twice_in_a_prompt_never_stalls_it():
    _run_images([_image_request("a", [2, ("X", 8), 3, ("Y", 8), 3, ("X", 8), 2])], budget=8, cache=8, batched=64)


@pytest.mark.parametrize("seed", range(6))
def test_random_image_workloads_always_find_their_images(seed):
    rng = random.Random(seed)
    pool = [(f"img{i}", rng.randint(2, 12)) for i in range(4)]
    biggest = max(n for _, n in pool)
    requests = []
    for i in range(12):
        parts: list = [rng.randint(1, 6)]
        for _ in range(rng.randint(0, 3)):
            parts += [rng.choice(pool), rng.randint(0, 5)]
        requests.append(_image_request(f"r{i}", parts, max_tokens=rng.randint(1, 4)))
    budget = rng.randint(biggest, 2 * biggest)
    _run_images(
        requests,
        budget=budget,
        cache=rng.randint(budget, 3 * biggest),
        batched=rng.choice([4, 9, 16, 64]),
        num_blocks=rng.choice([30, 60, 400]),  # few: preemption
    )
