"""Scheduler and cache features leave outputs unchanged, and show the effect they exist for."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams

from utils import check_greedy_close

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)


def _prompts(seed: int, n: int, shared: int = 0, lo: int = 5, hi: int = 120) -> list[dict]:
    rng = random.Random(seed)
    prefix = [rng.randrange(100, 40000) for _ in range(shared)]
    return [
        {"prompt_token_ids": prefix + [rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))]} for _ in range(n)
    ]


def _same(ref, outs):
    """On vs off must give the same greedy tokens, up to near-ties flipped by float summation order."""
    check_greedy_close(
        [o.outputs[0] for o in ref], [o.outputs[0] for o in outs], topk=5, min_exact_fraction=0.9, names=("off", "on")
    )


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny_llama_dir(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Outputs with every feature off and a cache large enough for everything at once."""
    llm = LLM(
        model=tiny_llama_dir,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_num_batched_tokens=4096,
        max_model_len=512,
        num_gpu_blocks_override=512,
    )
    prompts = _prompts(0, 10) + _prompts(1, 6, shared=70)
    return prompts, llm.generate(prompts, GREEDY, use_tqdm=False)


def _engine_is_clean(llm):
    s = llm.llm_engine.core.scheduler
    s.check_invariants()
    assert s.kv.pool.num_free_blocks == s.kv.num_blocks


@pytest.mark.parametrize("budget", [32, 77])
def test_chunked_prefill_does_not_change_outputs(tiny_llama_dir, reference, budget):
    prompts, ref = reference
    llm = LLM(
        model=tiny_llama_dir,
        enable_prefix_caching=False,
        enable_chunked_prefill=True,
        max_num_batched_tokens=budget,
        max_model_len=512,
        num_gpu_blocks_override=512,
    )
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    _same(ref, outs)
    _engine_is_clean(llm)


def test_unchunked_budget_under_the_context_is_refused_at_start(tiny_llama_dir):
    """Without chunked prefill a prompt is computed in one step: a budget under max_model_len would leave a long
    prompt waiting forever (it hung); refused at start, as vLLM does, naming the budget and both numbers."""
    from pagedllm.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match=r"max_num_batched_tokens \(64\).*max_model_len \(512\)") as e:
        LLM(model=tiny_llama_dir, enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=512)
    assert e.value.param == "max_num_batched_tokens"
    # a budget that holds the longest prompt: a prompt of max_model_len - 1 tokens runs whole in one step
    llm = LLM(model=tiny_llama_dir, enable_chunked_prefill=False, max_num_batched_tokens=128, max_model_len=128)
    out = llm.generate([{"prompt_token_ids": [5 + i % 200 for i in range(127)]}], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 1
    _engine_is_clean(llm)


def test_prefix_cache_hit_does_not_change_output(tiny_llama_dir, reference):
    prompts, ref = reference
    llm = LLM(model=tiny_llama_dir, enable_prefix_caching=True, max_model_len=512, num_gpu_blocks_override=512)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    _same(ref, first)
    # the six prompts sharing a 70-token prefix: all but the first admitted reuse its 4 full blocks
    assert sum(o.num_cached_tokens for o in first[10:]) >= 5 * 64
    again = llm.generate(prompts, GREEDY, use_tqdm=False)  # now every prompt's full blocks are cached
    _same(ref, again)
    assert all(o.num_cached_tokens >= 16 * ((len(p["prompt_token_ids"]) - 1) // 16) for o, p in zip(again, prompts))
    stats = llm.llm_engine.core.make_stats().prefix_cache
    assert stats.hits > 0 and stats.queries >= stats.hits
    _engine_is_clean(llm)


def test_preemption_under_tiny_cache_finishes_every_request(tiny_llama_dir, reference):
    prompts, ref = reference
    for caching in (False, True):
        llm = LLM(
            model=tiny_llama_dir,
            enable_prefix_caching=caching,
            max_model_len=224,
            num_gpu_blocks_override=14,
            max_num_batched_tokens=64,
        )
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.llm_engine.core.scheduler.num_preemptions > 0
        assert all(o.finished and len(o.outputs[0].token_ids) == 24 for o in outs)
        _same(ref, outs)
        _engine_is_clean(llm)


def test_priority_scheduling_runs_and_matches(tiny_llama_dir, reference):
    prompts, ref = reference
    llm = LLM(
        model=tiny_llama_dir,
        scheduling_policy="priority",
        max_model_len=224,
        num_gpu_blocks_override=14,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
    )
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=[i % 3 for i in range(len(prompts))])
    _same(ref, outs)
    _engine_is_clean(llm)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, max_model_len=256, num_gpu_blocks_override=256)


def test_chat_passes_tools_to_the_template(llm):
    """LLM.chat(..., tools=) as vLLM's: the tools reach the chat template."""
    template = "{% for t in tools or [] %}[TOOL {{ t.function.name }}]{% endfor %}{{ messages[0].content }}"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "hi"}]
    tok = llm.get_tokenizer()
    assert tok.decode(llm.apply_chat_template(msgs, template, tools=tools)) == "[TOOL get_weather]hi"
    (out,) = llm.chat(msgs, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template, tools=tools)
    assert out.prompt == "[TOOL get_weather]hi"


def test_outputs_come_back_in_input_order_with_vllm_fields(llm):
    prompts = [
        "Hello world, this is a longer prompt than the next one",
        "Hi",
        {"prompt": "Bonjour"},
        {"prompt_token_ids": [1, 2, 3]},
    ]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 5, 2, 4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5, 2, 4]
    assert outs[0].prompt == prompts[0] and outs[2].prompt == "Bonjour" and outs[3].prompt is None
    assert outs[3].prompt_token_ids == [1, 2, 3]
    tok = llm.get_tokenizer()
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "length" and o.finished
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert o.metrics.first_token_time >= o.metrics.arrival_time


def test_seeded_sampling_is_reproducible_across_batches_and_order(llm):
    p = {"prompt_token_ids": [11, 22, 33, 44]}
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = _prompts(5, 5)
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    mixed = llm.generate(others[:2] + [p] + others[2:], [unseeded] * 2 + [sp] + [unseeded] * 3, use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    last = llm.generate(others + [p], [unseeded] * 5 + [sp], use_tqdm=False)
    assert last[-1].outputs[0].token_ids == alone
    different = (
        llm.generate([p], SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    assert different != alone


def test_top_k_1_equals_greedy(llm):
    prompts = _prompts(7, 4)
    greedy = _ids(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False))
    topk1 = _ids(
        llm.generate(
            prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True, seed=3), use_tqdm=False
        )
    )
    assert topk1 == greedy


def test_eos_stop_token_ids_min_tokens_and_ignore_eos(llm):
    p = [{"prompt_token_ids": [100, 200, 300]}]
    free = llm.generate(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    ids = free.outputs[0].token_ids
    stop_tok = ids[5]
    first = ids.index(stop_tok)
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.token_ids == ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens masks the stop token until enough tokens exist
    later = llm.generate(
        p, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok], min_tokens=first + 1), use_tqdm=False
    )[0].outputs[0]
    assert len(later.token_ids) > first + 1 and stop_tok not in later.token_ids[: first + 1]
    # the model's EOS ends generation unless ignore_eos
    eos = llm.llm_engine.tokenizer.eos_token_id
    sp = SamplingParams(temperature=0, max_tokens=20)
    sp.bind_eos(frozenset({eos}))
    assert eos in sp._all_stop_token_ids


def test_min_tokens_forbids_eos_even_with_ignore_eos(llm):
    """vLLM's rule: ignore_eos lets EOS be generated without stopping, but min_tokens still forbids it, so
    ``min_tokens=max_tokens=N, ignore_eos=True`` (vLLM's benchmark workloads) never gives an EOS."""
    eos = llm.llm_engine.tokenizer.eos_token_id
    p = [{"prompt_token_ids": [100, 200, 300]}]
    sp = SamplingParams(temperature=0, max_tokens=12, min_tokens=8, ignore_eos=True, logit_bias={eos: 100})
    out = llm.generate(p, sp, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert eos not in out.token_ids[:8] and out.token_ids[8:] == [eos] * 4  # past min_tokens EOS wins, and goes on
    # without ignore_eos the same bias ends the output at the first token min_tokens allows
    stopped = llm.generate(
        p, SamplingParams(temperature=0, max_tokens=12, min_tokens=8, logit_bias={eos: 100}), use_tqdm=False
    )[0].outputs[0]
    assert stopped.token_ids[:8] == out.token_ids[:8] and stopped.token_ids[8:] == [eos]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None


def test_stop_token_text_is_left_out_unless_include_stop_str_in_output(llm):
    """vLLM's rule: an output ended by EOS or a stop_token_id keeps the token in token_ids but not its text,
    unless include_stop_str_in_output (with skip_special_tokens=False an EOS would otherwise show)."""
    tok = llm.llm_engine.tokenizer
    p = [{"prompt_token_ids": [100, 200, 300]}]
    ids = (
        llm.generate(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    stop_tok = next(t for t in ids[3:] if tok.decode([t]).strip())  # a token with visible text
    cut = ids.index(stop_tok) + 1
    for include in (False, True):
        out = llm.generate(
            p,
            SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok], include_stop_str_in_output=include),
            use_tqdm=False,
        )[0].outputs[0]
        assert out.token_ids == ids[:cut] and out.stop_reason == stop_tok
        assert out.text == tok.decode(ids[:cut] if include else ids[: cut - 1])
    eos = tok.eos_token_id
    for include in (False, True):
        out = llm.generate(
            p,
            SamplingParams(
                temperature=0,
                max_tokens=20,
                min_tokens=2,
                logit_bias={eos: 100},
                skip_special_tokens=False,
                include_stop_str_in_output=include,
            ),
            use_tqdm=False,
        )[0].outputs[0]
        assert out.token_ids == ids[:2] + [eos] and out.finish_reason == "stop"
        assert (tok.eos_token in out.text) == include


def test_stop_strings_trim_the_text(llm):
    p = [{"prompt_token_ids": [100, 200, 300]}]
    full = llm.generate(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = text.index(stop)
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        p,
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: cut + len(stop)]
    _engine_is_clean(llm)


def test_max_tokens_is_capped_by_the_context(llm):
    out = llm.generate(
        [{"prompt_token_ids": [9] * 250}],
        SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"


def _peak_blocks(llm, requests):
    """Run requests to completion step by step; return (outputs by id, most KV blocks in use at once)."""
    eng = llm.llm_engine
    for rid, prompt, sp in requests:
        eng.add_request(rid, prompt, sp)
    pool = eng.core.scheduler.kv.pool
    peak, outs = 0, {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        peak = max(peak, pool.num_blocks - pool.num_free_blocks)
    _engine_is_clean(llm)
    return outs, peak


def test_n8_shares_prompt_blocks_and_matches_independent_seeded_requests(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, enable_prefix_caching=False, max_model_len=1024, num_gpu_blocks_override=512)
    prompt = _prompts(11, 1, lo=512, hi=512)[0]
    sp = SamplingParams(n=8, temperature=1.0, top_p=0.95, seed=100, max_tokens=16, ignore_eos=True)
    outs, shared_peak = _peak_blocks(llm, [("group", prompt, sp)])
    group = outs["group"]
    assert [c.index for c in group.outputs] == list(range(8))
    single = [
        SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_tokens=16, ignore_eos=True) for i in range(8)
    ]
    indep, indep_peak = _peak_blocks(llm, [(f"r{i}", prompt, s) for i, s in enumerate(single)])
    assert [c.token_ids for c in group.outputs] == [indep[f"r{i}"].outputs[0].token_ids for i in range(8)]
    assert len({tuple(c.token_ids) for c in group.outputs}) > 1, "siblings must sample independently"
    assert shared_peak * 4 <= indep_peak, (shared_peak, indep_peak)


def test_n_siblings_with_prefix_caching_and_preemption_all_finish(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, max_model_len=224, num_gpu_blocks_override=14, max_num_batched_tokens=64)
    prompts = _prompts(12, 3, lo=40, hi=90)
    sp = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    assert all(len(o.outputs) == 3 and all(len(c.token_ids) == 20 for c in o.outputs) for o in outs)
    big = LLM(model=tiny_llama_dir, max_model_len=224, num_gpu_blocks_override=256)
    ref = big.generate(prompts, sp, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in ref]
    _engine_is_clean(llm)


def test_abort_of_an_n_group_frees_every_block(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, max_model_len=256, num_gpu_blocks_override=64)
    eng = llm.llm_engine
    eng.add_request(
        "g",
        {"prompt_token_ids": list(range(100, 150))},
        SamplingParams(n=4, temperature=1.0, max_tokens=50, ignore_eos=True),
    )
    for _ in range(3):
        eng.step()
    eng.abort_request(["g"])
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs and outs[-1].finished and all(c.finish_reason == "abort" for c in outs[-1].outputs)
    _engine_is_clean(llm)


def test_frequency_and_presence_penalties_reduce_repetition(llm):
    prompts = _prompts(21, 4)
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    penal = llm.generate(
        prompts,
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0),
        use_tqdm=False,
    )

    def max_repeats(o):
        ids = o.outputs[0].token_ids
        return max(ids.count(t) for t in ids)

    assert sum(map(max_repeats, plain)) > sum(map(max_repeats, penal))
    # penalties only act on tokens already generated: the first token is unchanged
    assert [o.outputs[0].token_ids[0] for o in plain] == [o.outputs[0].token_ids[0] for o in penal]


def test_repetition_penalty_and_bad_words(llm):
    p = [{"prompt_token_ids": [100, 200, 300]}]
    plain = llm.generate(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    first = plain.outputs[0].token_ids[0]
    banned_word = llm.get_tokenizer().decode([first])
    out = llm.generate(
        p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[banned_word]), use_tqdm=False
    )[0]
    bad_ids = llm.llm_engine.processor._bad_words_ids([banned_word])
    singles = {w[0] for w in bad_ids if len(w) == 1}
    assert first in singles and not singles & set(out.outputs[0].token_ids)
    rep = (
        llm.generate(
            p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=5.0), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    assert len(set(rep)) >= len(set(plain.outputs[0].token_ids))
    allowed = (
        llm.generate(
            p,
            SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=2, allowed_token_ids=[7, 8]),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    assert set(allowed) <= {7, 8}


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    long = {"prompt_token_ids": list(range(1000, 1100))}
    cut = llm.generate(
        [long], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, truncate_prompt_tokens=10), use_tqdm=False
    )[0]
    assert cut.prompt_token_ids == list(range(1090, 1100))
    same = llm.generate(
        [{"prompt_token_ids": list(range(1090, 1100))}],
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert cut.outputs[0].token_ids == same.outputs[0].token_ids


def test_user_logits_processors_both_signatures(llm):
    seen = []

    def only_even(output_ids, logits):
        seen.append(len(output_ids))
        mask = torch.full_like(logits, float("-inf"))
        mask[::2] = 0
        return logits + mask

    def echo_prompt(prompt_ids, output_ids, logits):
        target = prompt_ids[len(output_ids) % len(prompt_ids)]
        out = torch.full_like(logits, float("-inf"))
        out[target] = 0
        return out

    p = [{"prompt_token_ids": [301, 302, 303]}]
    even = (
        llm.generate(
            p,
            SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True, logits_processors=[only_even]),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    assert all(t % 2 == 0 for t in even) and seen == list(range(6))
    echo = (
        llm.generate(
            p,
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logits_processors=[echo_prompt]),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    assert echo == [301, 302, 303, 301, 302]


def test_seeded_outputs_reproduce_across_engine_instances(tiny_llama_dir, llm):
    p = _prompts(31, 3)
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=77, max_tokens=10, ignore_eos=True)
    a = _ids(llm.generate(p, sp, use_tqdm=False))
    other = LLM(model=tiny_llama_dir, max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=16)
    assert _ids(other.generate(list(reversed(p)), sp, use_tqdm=False)) == list(reversed(a))


def test_bad_logits_processor_and_output_kind_are_rejected():
    from pagedllm.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="logits_processors"):
        SamplingParams(logits_processors=[lambda x: x])
    with pytest.raises(InvalidParameterError, match="output_kind"):
        SamplingParams(output_kind="sometimes")
    with pytest.raises(InvalidParameterError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_kv_cache_prefault_makes_the_cache_resident_at_once():
    """Without it a large CPU cache becomes resident block by block as the free queue first hands each out
    (which a soak would read as a leak); with it, every page is written at start-up. Measured in a fresh
    process: late in a long test process the allocator may serve the prefaulted buffer from memory freed
    earlier and still resident (CI once saw no growth at all)."""
    import subprocess
    import sys

    code = """
import re
from pathlib import Path

import torch

from pagedllm.worker.kv_cache import allocate_kv_caches


def rss_mib():
    return int(re.search(r"VmRSS:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


for prefault in (False, True):  # 2 layers x 2 x 4096 blocks x 16 x 4 heads x 64 x 4 bytes = 256 MiB
    before = rss_mib()
    caches = allocate_kv_caches(2, 4096, 16, 4, 64, torch.float32, torch.device("cpu"), prefault=prefault)
    grew = rss_mib() - before
    assert all(float(c.abs().max()) == 0 for c in caches)  # zeros either way (read after measuring)
    del caches
    print(grew)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    grew_lazy, grew_prefaulted = map(float, out.stdout.split())
    assert grew_lazy < 32 and grew_prefaulted > 240, (grew_lazy, grew_prefaulted)


def test_a_large_cpu_cache_reads_as_zeros_even_over_dirty_freed_memory():
    """The C allocator may hand a large request memory freed earlier, dirty (CI once saw a cache that was
    not all zeros). Forced here in a child process: mallopt makes glibc serve everything from its heap and
    keep what is freed, so a freed 320 MiB of NaNs is there to reuse; the cache allocated next must still
    read as zeros."""
    import subprocess
    import sys

    code = """
import ctypes, torch
from pagedllm.worker.kv_cache import allocate_kv_caches
libc = ctypes.CDLL("libc.so.6")
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
assert libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
dirty = torch.full((80 << 20,), float("nan"))  # 320 MiB from the heap, then freed into it
del dirty
assert torch.empty(64 << 20).isnan().any(), "glibc did not reuse the freed memory: the test proves nothing"
caches = allocate_kv_caches(2, 4096, 16, 4, 64, torch.float32, torch.device("cpu"))
assert all(float(c.abs().max()) == 0 for c in caches), "the KV cache holds garbage"
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_sliding_window_groups_leave_seeded_n_gt_1_sampling_and_preemption_unchanged(tiny_model_factory):
    """Tiny Gemma 3 (a local layer with a 32-token window beside a global one): n=3 siblings forked off each
    prompt (a copy of the last block in each group), seeded sampling, prompts past the window and preemptions,
    with the local layer's own block tables and without them: the same tokens, and every block back."""
    model = str(tiny_model_factory("gemma3"))
    prompts = [
        {"prompt_token_ids": [(i * 37 + j) % 4000 + 10 for j in range(n)]} for i, n in enumerate([5, 90, 140, 33])
    ]
    params = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, n=3, seed=7)
    outs = {}
    for hybrid, num_blocks in ((True, 64), (False, 40)):  # a hybrid block holds one of the two layers: less memory
        llm = LLM(
            model,
            num_gpu_blocks_override=num_blocks,
            max_num_batched_tokens=64,
            disable_hybrid_kv_cache_manager=not hybrid,
        )
        assert (llm.llm_engine.kv_groups is not None) == hybrid
        outs[hybrid] = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
        sched = llm.llm_engine.core.scheduler
        assert sched.num_preemptions > 0
        sched.check_invariants()
        assert sched.kv.pool.num_free_blocks == num_blocks
    assert outs[True] == outs[False]
