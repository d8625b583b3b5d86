"""Speculative decoding changes nothing about what comes out, only how many passes it takes.

Each proposer is checked against the same engine without speculation: greedy and
seeded-sampled tokens (and logprobs) are identical, with chunked prefill, prefix
caching, preemption, n>1, penalties and stop strings in the same batch. The
counted effect is the accepted-draft tally. The rejection rule itself is checked
for exactness with chi-square tests on a tiny vocabulary.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidParameterError
from pagedllm.sample import Sampler, SamplingBatch
from pagedllm.sample.rejection import verify
from pagedllm.spec_decode.gate import CostGate
from pagedllm.spec_decode.ngram import find_continuation

SELF_INT8 = {"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 3}

COPY = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n\n"


def _mixed_params() -> list[SamplingParams]:
    """Greedy, seeded top-p, penalties + min_tokens + bad words, a stop string, logprobs: one batch."""
    return [
        SamplingParams(max_tokens=40, temperature=0, logprobs=3),
        SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=11),
        SamplingParams(
            max_tokens=40,
            temperature=1.0,
            top_k=20,
            seed=5,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            min_tokens=8,
        ),
        SamplingParams(max_tokens=40, temperature=0, stop=["b"], bad_words=["return"]),
        SamplingParams(max_tokens=30, temperature=0.7, seed=3, n=3),
    ]


def _prompts() -> list[str]:
    return [COPY * 2, COPY + "def add", "Repeat: one two three one two three one two", COPY[:60], COPY * 2 + "def"]


def _generate(llm: LLM, prompts, params) -> list[list[tuple]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        [
            (
                c.text,
                c.token_ids,
                c.finish_reason,
                [sorted((t, round(lp.logprob, 4)) for t, lp in e.items()) for e in c.logprobs] if c.logprobs else None,
            )
            for c in o.outputs
        ]
        for o in outs
    ]


def _spec_stats(llm: LLM):
    return llm.llm_engine.core.make_stats().spec_decode


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory):
    return tiny_model_factory("llama")


ENGINE_SETTINGS = {
    "default": {},
    "chunked_small_budget": {"max_num_batched_tokens": 24},
    "small_cache_preemption": {"num_gpu_blocks_override": 12, "max_model_len": 128},
    "no_prefix_cache": {"enable_prefix_caching": False},
}


@pytest.mark.parametrize("setting", list(ENGINE_SETTINGS))
def test_tiny_model_outputs_identical_with_and_without_speculation(tiny_dir, setting):
    """The int8 self-draft agrees with the float32 target most of the time, not always: both paths run."""
    spec = SELF_INT8
    kw = {"max_model_len": 256, "num_gpu_blocks_override": 128, **ENGINE_SETTINGS[setting]}
    base = LLM(str(tiny_dir), **kw)
    prompts = _prompts()
    params = _mixed_params()
    want = _generate(base, prompts, params)
    llm = LLM(str(tiny_dir), speculative_config=spec, **kw)
    assert _generate(llm, prompts, params) == want
    stats = _spec_stats(llm)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if setting == "small_cache_preemption":
        assert llm.llm_engine.core.scheduler.num_preemptions > 0
    sched = llm.llm_engine.core.scheduler
    sched.check_invariants()
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks  # every block came back


@pytest.mark.parametrize("setting", ["chunked_small_budget", "small_cache_preemption"])
def test_a_draft_model_behind_a_prompt_lookup_changes_no_token(setting):
    """ngram_first: the lookup drafts where SmolLM2 quotes code it is asked to repeat, its int8 self-draft
    elsewhere (the draft's KV catching up on the tokens it sat out); with chunked prefill and with preemption
    the outputs are the engine's without speculation (float32 weights, as in the n-gram test below)."""
    kw = {**ENGINE_SETTINGS[setting], "max_model_len": 192, "quantization": "none"}
    if setting == "small_cache_preemption":
        kw["num_gpu_blocks_override"] = 12
    base = LLM(**kw)
    spec = {**SELF_INT8, "ngram_first": True, "backoff_by_cost": False, "backoff_after_rejections": 0}
    llm = LLM(speculative_config=spec, **kw)
    proposer = llm.llm_engine.core.runner.proposer
    counts = {"lookup": 0, "model": 0}
    lookup, logits = proposer._lookup, proposer._logits

    def counted_lookup(ctx):
        found = lookup(ctx)
        counts["lookup"] += len(found)
        return found

    def counted_logits(hidden):
        counts["model"] += 1
        return logits(hidden)

    proposer._lookup, proposer._logits = counted_lookup, counted_logits
    code = "def area(w, h):\n    return w * h\n\nprint(area(3, 4))\n" * 3
    copy = base.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": f"Repeat this code exactly:\n{code}"}], add_generation_prompt=True, tokenize=False
    )
    prompts = [copy, "The history of the river town begins", copy + "def"]
    params = [
        SamplingParams(max_tokens=60, temperature=0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=42, n=2),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
    ]
    assert _generate(llm, prompts, params) == _generate(base, prompts, params)
    assert counts["lookup"] > 5 and counts["model"] > 5, counts
    stats = _spec_stats(llm)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    sched = llm.llm_engine.core.scheduler
    sched.check_invariants()
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_other_families_with_a_different_draft_model(tiny_model_factory, family):
    """A separate draft (other weights, same vocabulary) is mostly rejected: output must not move."""
    target, draft = tiny_model_factory(family), tiny_model_factory(family, seed=1)
    kw = {"max_model_len": 256, "num_gpu_blocks_override": 96, "max_num_batched_tokens": 32}
    prompts = [COPY * 2, "The river town", COPY]
    params = SamplingParams(max_tokens=32, temperature=0)
    want = _generate(LLM(str(target), **kw), prompts, params)
    llm = LLM(
        str(target),
        speculative_config={
            "method": "draft_model",
            "model": str(draft),
            "num_speculative_tokens": 3,
            "backoff_after_rejections": 0,
        },
        **kw,
    )
    assert _generate(llm, prompts, params) == want
    stats = _spec_stats(llm)
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # rejections happened and were rolled back


def test_prefix_cache_hit_with_speculation(tiny_dir):
    llm = LLM(str(tiny_dir), max_model_len=256, num_gpu_blocks_override=128, speculative_config=SELF_INT8)
    base = LLM(str(tiny_dir), max_model_len=256, num_gpu_blocks_override=128)
    params = SamplingParams(max_tokens=24, temperature=0)
    first = _generate(llm, [COPY * 2], params)
    again = llm.generate([COPY * 2 + "x"], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32
    assert _generate(llm, [COPY * 2 + "x"], params) == _generate(base, [COPY * 2 + "x"], params)
    assert first == _generate(base, [COPY * 2], params)


@pytest.mark.parametrize("setting", ["chunked_small_budget", "small_cache_preemption"])
def test_smollm2_ngram_identical_and_mostly_accepted(setting):
    """SmolLM2 quotes code it is asked to repeat: n-gram drafts are mostly accepted, nothing changes, to the bit:
    float32 weights (quantization="none"), whose kernels give oneDNN's bits at every row count, so verifying
    drafts scores each token exactly as plain decode does (the GGUF's own blocks, the default, agree up to
    summation order, enough to move a sampled token at temperature 0.9)."""
    kw = {**ENGINE_SETTINGS[setting], "max_model_len": 192, "quantization": "none"}
    if setting == "small_cache_preemption":
        kw["num_gpu_blocks_override"] = 12
    base = LLM(**kw)
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **kw)
    tok = base.get_tokenizer()
    code = "def area(w, h):\n    return w * h\n\nprint(area(3, 4))\n" * 3
    copy = tok.apply_chat_template(
        [{"role": "user", "content": f"Repeat this code exactly:\n{code}"}], add_generation_prompt=True, tokenize=False
    )
    prompts = [copy, "The quick brown fox jumps over the lazy dog. The quick brown fox", copy + "def"]
    params = [
        SamplingParams(max_tokens=80, temperature=0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=42, n=2),
        SamplingParams(max_tokens=40, temperature=0, stop=["print"], frequency_penalty=0.3),
    ]
    assert _generate(llm, prompts, params) == _generate(base, prompts, params)
    stats = _spec_stats(llm)
    assert stats.num_accepted_tokens >= 0.3 * stats.num_draft_tokens > 0  # the copy is drafted well, the rest not
    if setting == "small_cache_preemption":
        assert llm.llm_engine.core.scheduler.num_preemptions > 0
    out = llm.generate(prompts[:1], params[0], use_tqdm=False)[0]
    assert out.metrics.spec_num_accepted_tokens > 0
    assert out.metrics.spec_num_draft_tokens >= out.metrics.spec_num_accepted_tokens


def test_backoff_stops_drafting_when_nothing_is_accepted(tiny_model_factory):
    """A draft that is always wrong: drafting pauses (doubling) instead of costing every step."""
    target, draft = tiny_model_factory("llama"), tiny_model_factory("llama", seed=1)
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    counts = {}
    for backoff in (0, 2):
        llm = LLM(
            str(target),
            max_model_len=256,
            num_gpu_blocks_override=64,
            speculative_config={
                "method": "draft_model",
                "model": str(draft),
                "num_speculative_tokens": 2,
                "backoff_after_rejections": backoff,
                "backoff_by_cost": False,  # the rejection back-off alone: this machine's speed plays no part
            },
        )
        llm.generate(["The river town"], params, use_tqdm=False)
        counts[backoff] = _spec_stats(llm).num_drafts
    assert counts[2] < counts[0] / 2


def test_adaptive_draft_length_grows_where_drafts_hold_shrinks_where_they_fail_and_changes_no_token(
    tiny_model_factory,
):
    """adaptive_length: a draft that agrees with its target (its own weights in int8) keeps drafting the whole
    num_speculative_tokens; one that never agrees (other random weights) soon drafts one token a step. Tokens
    are those of no speculation either way."""
    target, wrong = tiny_model_factory("llama"), tiny_model_factory("llama", seed=1)
    kw = {"max_model_len": 256, "num_gpu_blocks_override": 128}
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    prompts = [COPY, "The river town"]
    want = _generate(LLM(str(target), **kw), prompts, params)
    fixed = {"num_speculative_tokens": 4, "backoff_after_rejections": 0, "backoff_by_cost": False}
    mean_len = {}
    for name, draft in (("agrees", {"quantization": "int8"}), ("wrong", {"model": str(wrong)})):
        for adaptive in (False, True):
            cfg = {"method": "draft_model", **draft, **fixed, "adaptive_length": adaptive}
            llm = LLM(str(target), speculative_config=cfg, **kw)
            assert _generate(llm, prompts, params) == want
            stats = _spec_stats(llm)
            mean_len[name, adaptive] = stats.num_draft_tokens / stats.num_drafts
    assert min(mean_len["agrees", False], mean_len["wrong", False]) > 3.8  # 4, but near max_tokens
    assert mean_len["agrees", True] > 3, mean_len
    assert mean_len["wrong", True] < 1.3, mean_len


def _run_gate(gate: CostGate, speedup, steps: int, noise: float = 0.0, seed: int = 0) -> float:
    """Tokens per second over ``steps`` decode steps steered by ``gate``: a plain step emits 1 token in 1 s, a
    drafting one 2 tokens at ``speedup(step)`` times that rate; times jitter by +-``noise``."""
    rng = np.random.default_rng(seed)
    tokens = seconds = 0.0
    for i in range(steps):
        drafting = gate.allow()
        n, t = (2.0, 2.0 / speedup(i)) if drafting else (1.0, 1.0)
        t *= 1 + noise * rng.uniform(-1, 1)
        gate.record(drafting, n, t)
        tokens, seconds = tokens + n, seconds + t
    return tokens / seconds


@pytest.mark.parametrize("speedup", [0.3, 0.8, 0.93, 1.1, 1.6, 3.0])
def test_the_cost_gate_keeps_the_faster_of_drafting_and_plain_decoding(speedup):
    """Whether drafting pays or not, and with 20 % jitter in every step's time, the gate runs within 5 % of
    the faster mode: slower drafting costs only its short probes between ever longer pauses."""
    rate = _run_gate(CostGate(), lambda i: speedup, 3000, noise=0.2)
    assert rate >= 0.95 * max(1.0, speedup)


def test_the_cost_gate_resumes_drafting_once_it_pays_again():
    gate = CostGate()
    _run_gate(gate, lambda i: 0.5, 2000)
    assert gate.pause == gate.max_pause  # drafting that never pays: paused as long as the gate pauses
    drafted = []  # then a copy-heavy stretch: back to drafting once the pause ends, and for good
    for _ in range(2000):
        drafted.append(gate.allow())
        gate.record(drafted[-1], 2.0 if drafted[-1] else 1.0, 1.0)
    first = drafted.index(True)
    assert first <= gate.max_pause and sum(drafted[first:]) >= 0.98 * len(drafted[first:])
    _run_gate(gate, lambda i: 0.5, 2000)
    gate.restart()  # a request at an idle engine: drafting is measured again at once, not after the pause
    assert [gate.allow() for _ in range(gate.probe)] == [True] * gate.probe


def test_the_cost_gate_judges_each_new_request_by_its_first_drafting_step():
    """Short answers at an idle engine, drafting losing (0.5x: prose) and paying (2x: a copy) in turn: after the
    first, each runs within 5 % of its faster mode: a request is not stuck in the pause the last one earned."""
    gate, rates = CostGate(), []
    for j, speedup in enumerate([0.5, 2.0] * 5):
        gate.restart()
        rates.append(_run_gate(gate, lambda i, s=speedup: s, 80, noise=0.1, seed=j) / max(1.0, speedup))
    assert min(rates[1:]) >= 0.95, rates


def test_a_lucky_first_drafting_step_does_not_keep_a_losing_request_drafting():
    """Qwen2.5-Coder 0.5B drafting a chat answer for the 1.5B here: a drafting step (k = 4) costs 4.22 plain
    steps and emits 3.1 tokens on average, all 5 about a quarter of the time. After a lucky first step, the
    first losing one must end drafting: its average with the lucky one no longer pays. (A weighted average that
    began at the lucky step needed a third step, and on 85-token answers such steps cost more than the 5 %
    the gate allows.)"""
    gate = CostGate()
    for _ in range(2 * gate.probe):  # an earlier answer measured both modes: plain decoding at 1 token/s
        drafting = gate.allow()
        gate.record(drafting, 3.0 if drafting else 1.0, 4.22 if drafting else 1.0)
    gate.restart()
    steps = []
    for tokens in (5.0, 2.0, 2.0, 2.0):
        steps.append(gate.allow())
        gate.record(steps[-1], tokens if steps[-1] else 1.0, 4.22 if steps[-1] else 1.0)
    assert steps == [True, True, False, False]


def test_a_draft_models_catch_up_after_a_pause_lengthens_the_next_pause():
    """Each probe after a pause begins with a step in which the draft model catches up on the pause's tokens
    (0.11 s beyond a 0.04 s plain step for the 0.5B drafting for the 1.5B here): it is part of the probe's
    cost, so the pause that a near break-even probe earns is long enough to pay for it."""
    pauses = {}
    for catchup in (0.0, 0.11):
        gate = CostGate()
        for _ in range(2 * gate.probe):  # both modes measured: plain 0.04 s a token, drafting 0.17 s for 4
            drafting = gate.allow()
            gate.record(drafting, 4.0 if drafting else 1.0, 0.17 if drafting else 0.04)
        if catchup:
            gate.record_catchup(0.04 + catchup)
        gate.restart()
        assert gate.allow()
        gate.record(True, 4.0, 0.17)
        assert not gate.allow()
        pauses[catchup] = gate.pause
    # the catch-up costs 0.11 s x 25 tokens/s = 2.75 plain steps' time more a probe: at 2 % of the pause, 137.5
    assert pauses[0.0] >= gate.probe and pauses[0.11] - pauses[0.0] in (137, 138), pauses


def _slowed(record, factor: float):
    """A gate's record() that sees drafting steps take ``factor`` times their time."""
    return lambda drafting, tokens, seconds: record(drafting, tokens, seconds * (factor if drafting else 1))


def test_cost_backoff_keeps_drafts_that_do_not_pay_out_and_changes_no_token(tiny_dir):
    """Drafting made to look 50x slower than it is: the gate keeps drafts out of most steps, and the tokens
    are those of the engine without speculation."""
    kw = {"max_model_len": 256, "num_gpu_blocks_override": 128}
    params = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
    want = _generate(LLM(str(tiny_dir), **kw), [COPY], params)
    drafts = {}
    for by_cost in (False, True):
        llm = LLM(str(tiny_dir), speculative_config={**SELF_INT8, "backoff_by_cost": by_cost}, **kw)
        gate = llm.llm_engine.core.runner.cost_gate
        if by_cost:
            gate.record = _slowed(gate.record, 50)
        else:
            assert gate is None
        assert _generate(llm, [COPY], params) == want
        drafts[by_cost] = _spec_stats(llm).num_drafts
    assert gate.paused_steps > 20 and 0 < drafts[True] < drafts[False] / 2


def test_the_step_that_verifies_the_last_drafts_before_a_pause_is_not_timed_as_drafting(tiny_dir):
    """It verifies drafts but proposes none (the gate has just paused drafting): a drafting step's tokens at
    a fraction of its cost. Timed as drafting, it made drafting look faster than it is."""
    llm = LLM(str(tiny_dir), max_model_len=256, num_gpu_blocks_override=128, speculative_config=SELF_INT8)
    gate = llm.llm_engine.core.runner.cost_gate
    steps: list[list] = []  # per step: [whether the gate allowed drafts (None: not asked), recorded as drafting]
    record = gate.record

    def allowed() -> bool:  # the gate's answers scripted (its own follow this machine's timings)
        ok = len(steps) % 3 != 0  # drafting paused every third step
        steps.append([ok, None])
        return ok

    def recorded(drafting: bool, tokens: float, seconds: float) -> None:
        steps[-1][1] = drafting
        record(drafting, tokens, seconds)

    gate.allow, gate.record = allowed, recorded
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    assert _generate(llm, [COPY], params) == _generate(LLM(str(tiny_dir), max_model_len=256), [COPY], params)
    assert sum(1 for ok, drafting in steps if ok and drafting) > 5  # drafting steps are timed
    assert not [s for s in steps if s == [False, True]]


def test_disable_by_batch_size(tiny_dir):
    llm = LLM(
        str(tiny_dir),
        max_model_len=256,
        num_gpu_blocks_override=128,
        speculative_config={**SELF_INT8, "disable_by_batch_size": 2},
    )
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    llm.generate(["a b c", "d e f", "g h i"], params, use_tqdm=False)  # 3 running > 2: never drafts
    assert _spec_stats(llm).num_drafts == 0
    llm.generate(["a b c"], params, use_tqdm=False)
    assert _spec_stats(llm).num_drafts > 0


# -- the rejection rule is exact ------------------------------------------------------------------------

V = 8


def _batch(n: int, temperature: float, top_p: float, seed: int, pos0: int) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.full((n,), temperature),
        top_k=torch.zeros(n, dtype=torch.long),
        top_p=torch.full((n,), top_p),
        min_p=torch.zeros(n),
        seeds=[seed] * n,
        positions=list(range(pos0, pos0 + n)),
        stop_masks=[None] * n,
        num_logprobs=[None] * n,
        all_greedy=temperature == 0,
        no_top_k=True,
        no_top_p=top_p >= 1.0,
        no_min_p=True,
        want_probs=True,
    )


def _chi2_ok(counts: np.ndarray, probs: np.ndarray) -> bool:
    """Pearson chi-square against `probs` at significance 1e-4 (Wilson-Hilferty critical value)."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    n = counts.sum()
    expected = probs[support] * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    if df == 0:
        return True  # one token in the support, and nothing was emitted outside it
    z = 3.719  # 1 - 1e-4 quantile of the standard normal
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit


@pytest.mark.parametrize("temperature,top_p", [(0.5, 0.9), (1.0, 0.9), (1.0, 1.0)])
@pytest.mark.parametrize("proposer", ["one_hot_unlikely", "skewed_q"])
def test_rejection_sampling_is_exact_in_distribution(temperature, top_p, proposer):
    """Each position's emitted token follows the target's processed distribution, whatever q is.

    The target's logits are fixed per position (so positions are independent and each has a known
    processed distribution p_j); a generation loop drafts 3 tokens per step from q, verifies them, and
    continues from the first unverified position, as the engine does.
    """
    g = torch.Generator().manual_seed(0)
    num_pos, k, trials = 4, 3, 3000
    logits = torch.randn(num_pos + k + 1, V, generator=g)
    sampler = Sampler()
    ref = sampler(logits.clone(), _batch(len(logits), temperature, top_p, 0, 0)).probs  # p_j per position
    counts = np.zeros((num_pos, V))
    rng = np.random.default_rng(1)
    for t in range(trials):
        seed, out = 1000 + t, []
        while len(out) < num_pos:
            pos = len(out)
            if proposer == "one_hot_unlikely":  # always the least likely token: q is one-hot, far from p
                drafts, q = [int(ref[pos + j].argmin()) for j in range(k)], None
            else:  # q puts 70% on the least likely token, the rest uniform
                q = torch.full((k, V), 0.3 / (V - 1))
                for j in range(k):
                    q[j, int(ref[pos + j].argmin())] = 0.7
                drafts = [int(rng.choice(V, p=q[j].numpy() / q[j].sum().item())) for j in range(k)]
            rows = logits[pos : pos + k + 1].clone()
            s = sampler(rows, _batch(k + 1, temperature, top_p, seed, pos))
            out += verify(
                drafts,
                s.token_ids.tolist(),
                draft_probs=q,
                probs=s.probs[:k] if q is not None else None,
                seed=seed,
                position=pos,
            )
        for j in range(num_pos):
            counts[j, out[j]] += 1
    for j in range(num_pos):
        assert _chi2_ok(counts[j], ref[j].numpy()), (j, counts[j] / trials, ref[j].numpy())


def test_one_hot_verification_reproduces_the_non_speculative_draws():
    """With one-hot drafts the emitted tokens are the sampler's own draws: seeded outputs do not move."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, V, generator=g)
    s = Sampler()(logits.clone(), _batch(5, 1.0, 1.0, 77, 10))
    target = s.token_ids.tolist()
    assert verify(target[:4], target) == target  # all accepted + bonus
    wrong = [(target[0] + 1) % V] + target[1:4]
    assert verify(wrong, target) == target[:1]  # first rejected: the target's own draw


# -- the n-gram lookup ---------------------------------------------------------------------------------


def test_find_continuation_longest_then_most_recent():
    a = np.array([1, 2, 3, 9, 9, 2, 3, 7, 7, 1, 2, 3])
    # "1 2 3" occurred at 0..2 (followed by 9 9 2 3) — longer than the later "2 3" match
    assert find_continuation(a, 2, 3, 4) == [9, 9, 2, 3]
    assert find_continuation(np.array([5, 6, 5, 6, 5, 6]), 2, 4, 3) == [5, 6]  # most recent, cut at the end
    assert find_continuation(np.array([1, 2, 3, 4]), 2, 4, 3) == []
    assert find_continuation(np.array([1, 2, 3, 1]), 1, 4, 2) == [2, 3]
    assert find_continuation(np.array([1, 2, 3, 1]), 2, 4, 2) == []  # only a 1-gram matches
    big = np.tile(np.arange(1000), 50)
    assert find_continuation(big, 2, 4, 5) == [0, 1, 2, 3, 4]


# -- bad input -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg,field",
    [
        ({"method": "magic", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup_min"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "model"),  # a head needs its directory
        ({"method": "medusa", "num_speculative_tokens": 2, "model": "/x", "quantization": "int8"}, "quantization"),
        ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "int4"}, "quantization"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "quantization": "fp8"}, "quantization"),
        ({"method": "ngram", "num_speculative_tokens": 2, "backoff_by_cost": "yes"}, "backoff_by_cost"),
        ({"method": "ngram", "num_speculative_tokens": 2, "adaptive_length": 1}, "adaptive_length"),
        ({"method": "ngram", "num_speculative_tokens": 2, "ngram_first": True}, "ngram_first"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "ngram_first": "yes"}, "ngram_first"),
        ("{not json", "speculative_config"),
    ],
)
def test_bad_speculative_config_is_refused_naming_the_field(cfg, field):
    from pagedllm.config import EngineConfig

    with pytest.raises(InvalidParameterError) as e:
        EngineConfig.from_kwargs(speculative_config=cfg)
    assert field in str(e.value)


def test_draft_with_another_vocabulary_is_refused_at_startup(tiny_model_factory):
    target, draft = tiny_model_factory("llama"), tiny_model_factory("llama", vocab_size=1000)
    with pytest.raises(InvalidParameterError, match="vocabulary"):
        LLM(
            str(target),
            num_gpu_blocks_override=16,
            speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2},
        )


def test_a_gguf_mode_for_a_draft_that_is_no_gguf_is_refused_at_startup(tiny_model_factory):
    """speculative_config.quantization takes a GGUF draft's own modes (gguf, gguf-exact); on a draft that is no
    GGUF file it is a clear error naming the mode, not a silent fallback."""
    with pytest.raises(InvalidParameterError, match="gguf"):
        LLM(
            str(tiny_model_factory("llama")),
            num_gpu_blocks_override=16,
            speculative_config={"method": "draft_model", "quantization": "gguf", "num_speculative_tokens": 2},
        )


def _draft_activation_bits(llm: LLM) -> int | None:
    return llm.llm_engine.core.executor.worker.draft.layers[0].mlp.down_proj.activation_bits


def test_a_gguf_draft_runs_its_fastest_arithmetic_in_the_c_decode_loop_and_changes_no_token():
    """A draft's arithmetic never reaches the output (the target verifies every token), so a GGUF draft, here the
    embedded model drafting for itself, defaults to int8 activations ("gguf") whatever the target runs, and its
    one-token passes run in the C decode loop like the target's decodes; the greedy tokens are those without
    speculation. An explicit speculative_config.quantization still decides."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = ["The capital of France is", COPY]
    plain = [o.outputs[0].token_ids for o in LLM(max_model_len=256).generate(prompts, params, use_tqdm=False)]
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "backoff_by_cost": False}
    llm = LLM(max_model_len=256, speculative_config=spec)
    assert _draft_activation_bits(llm) == 8
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
    draft = llm.llm_engine.core.executor.worker.draft
    assert draft.fused_decode is not None and draft.fused_decode.steps > 10
    assert _spec_stats(llm).num_drafts > 0
    exact = LLM(max_model_len=256, speculative_config={**spec, "quantization": "gguf-exact"})
    assert _draft_activation_bits(exact) is None


def test_server_flag_and_metrics(tiny_dir):
    """`pagedllm serve --speculative-config JSON`: same completion as without, counters on /metrics."""
    import json

    import httpx

    from utils import Server

    body = {"model": "tiny", "prompt": COPY, "max_tokens": 24, "temperature": 0}
    srv = Server(str(tiny_dir), "--speculative-config", json.dumps(SELF_INT8))
    try:
        got = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()
        drafts = srv.metric("pagedllm:spec_decode_num_draft_tokens_total")
        accepted = srv.metric("pagedllm:spec_decode_num_accepted_tokens_total")
        assert srv.metric("pagedllm:spec_decode_num_drafts_total") > 0
        assert 0 < accepted <= drafts
        assert srv.metric("pagedllm:spec_decode_num_accepted_tokens_per_pos_total") > 0
    finally:
        srv.stop()
    base = LLM(str(tiny_dir), max_model_len=256, num_gpu_blocks_override=128)
    want = base.generate([COPY], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0].outputs[0].text
    assert got["choices"][0]["text"] == want
