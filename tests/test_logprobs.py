"""Logprobs (generated and prompt) against transformers' log_softmax on the same weights."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams

TOL = 1e-4  # fp32


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return str(tiny_model_factory("qwen2"))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_logprobs(hf_model, ids):
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _prompts(n, lo, hi, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("budget", [2048, 16])  # whole prompts, and prompts chunked over many steps
def test_prompt_and_generated_logprobs_match_transformers(model_dir, hf_model, budget):
    llm = LLM(model=model_dir, max_model_len=512, num_gpu_blocks_override=256, max_num_batched_tokens=budget)
    prompts = _prompts(4, 5, 60)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=4, prompt_logprobs=3),
        use_tqdm=False,
    )
    for prompt, out in zip(prompts, outs):
        gen = out.outputs[0].token_ids
        ref = _hf_logprobs(hf_model, prompt + gen)
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        for pos in range(1, len(prompt)):
            entry = plp[pos]
            assert abs(entry[prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < TOL
            # rank among 49k tokens: exact up to ties within the float tolerance
            lp = ref[pos - 1, prompt[pos]]
            lo, hi = (int((ref[pos - 1] > lp + d).sum()) + 1 for d in (TOL, -TOL))
            assert lo <= entry[prompt[pos]].rank <= hi
            top = ref[pos - 1].topk(3)
            ranked = sorted((v for v in entry.values() if v.rank <= 3), key=lambda v: v.rank)
            assert [v.logprob for v in ranked] == pytest.approx(top.values.tolist(), abs=TOL)
        for j, tok in enumerate(gen):
            row = ref[len(prompt) - 1 + j]
            assert abs(out.outputs[0].logprobs[j][tok].logprob - row[tok].item()) < TOL
            assert tok == int(row.argmax())


def test_prompt_logprobs_bypass_the_prefix_cache(model_dir):
    llm = LLM(model=model_dir, max_model_len=512, num_gpu_blocks_override=256)
    prompt = {"prompt_token_ids": _prompts(1, 70, 70, seed=3)[0]}
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    first = llm.generate([prompt], sp, use_tqdm=False)[0]
    again = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert all(
        (a is None and b is None) or a.keys() == b.keys() for a, b in zip(first.prompt_logprobs, again.prompt_logprobs)
    )
    cached = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert cached.num_cached_tokens > 0 and cached.prompt_logprobs is None


def test_processed_logprobs_describe_the_sampled_distribution(model_dir):
    llm = LLM(model=model_dir, max_model_len=256, num_gpu_blocks_override=64, logprobs_mode="processed_logprobs")
    raw_llm = LLM(model=model_dir, max_model_len=256, num_gpu_blocks_override=64)
    p = [{"prompt_token_ids": [101, 202, 303, 404]}]
    sp = SamplingParams(temperature=0.5, top_k=3, seed=9, max_tokens=5, ignore_eos=True, logprobs=5)
    proc = llm.generate(p, sp, use_tqdm=False)[0].outputs[0]
    raw = raw_llm.generate(p, sp, use_tqdm=False)[0].outputs[0]
    assert proc.token_ids == raw.token_ids  # the mode changes what is reported, not what is sampled
    for step_p, step_r, tok in zip(proc.logprobs, raw.logprobs, proc.token_ids):
        finite = [v for v in step_p.values() if v.logprob > float("-inf")]
        assert len(finite) == 3  # top-k=3: everything else has probability 0
        assert sum(torch.tensor(v.logprob).exp().item() for v in finite) == pytest.approx(1.0, abs=1e-5)
        # temperature 0.5 doubles the raw logit gaps between the kept tokens
        top = sorted(step_r.values(), key=lambda v: v.rank)[:3]
        ptop = sorted(step_p.values(), key=lambda v: v.rank)[:3]
        for a, b in zip(top[1:], ptop[1:]):
            assert (b.logprob - ptop[0].logprob) == pytest.approx(2 * (a.logprob - top[0].logprob), abs=1e-4)
        assert tok in step_p
