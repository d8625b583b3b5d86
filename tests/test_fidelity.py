"""The engine computes the same model as transformers.

Every supported architecture family, as a tiny random-weight checkpoint, and the
embedded SmolLM2 GGUF are decoded greedily by pagedllm (all prompts in one
``generate`` call, so chunked prefills and batched decodes mix) and by
transformers one prompt at a time; ``check_greedy_close`` holds them to the
project's rule. Prefix caching is off here so the comparison is the model
itself; the on/off equality is tested elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams

from utils import GreedyResult, check_greedy_close, hf_greedy

TOPK = 5
# Both sides run float32: the chosen tokens' logprobs agree to ~2e-5 (measured, 30-layer SmolLM2),
# while a real modelling slip is far larger (rms_norm_eps 1e-6 instead of 1e-5 moves them by ~2e-3).
LOGPROB_ATOL = 2e-4
# A legitimate float32 divergence is a near-tie; a wrong model picks tokens that lose by more.
MAX_DIVERGENCE_GAP = 1e-2

TEXT_PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Voilà: 北京的天气 ☀️ — ça va? Ünïcödé text with emoji 🙂🚀 and numbers 12345.",
]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=TOPK, ignore_eos=True)


# ---------------------------------------------------------------- the comparison rule itself


def _seq(tokens: list[int], steps: list[dict[int, float]]) -> GreedyResult:
    return GreedyResult(tokens, steps)


def test_check_greedy_close_accepts_a_near_tie_divergence() -> None:
    ref = [_seq([1, 2], [{1: -0.1, 9: -3.0}, {2: -0.50, 3: -0.501}])]
    ours = [_seq([1, 3], [{1: -0.1, 9: -3.0}, {3: -0.50, 2: -0.501}])]
    result = check_greedy_close(ref, ours, topk=2, min_exact_fraction=0.0, max_divergence_gap=0.01)
    assert result.divergence == [1]


def test_check_greedy_close_rejects_a_token_outside_the_other_top_k() -> None:
    ref = [_seq([1], [{1: -0.1, 2: -3.0, 3: -4.0}])]
    ours = [_seq([7], [{7: -0.1, 1: -3.0}])]
    with pytest.raises(AssertionError, match="top-k"):
        check_greedy_close(ref, ours, topk=3, min_exact_fraction=0.0)


def test_check_greedy_close_rejects_every_sequence_diverging_at_token_0() -> None:
    # each divergence alone is allowed (both tokens in both top-k), but no sequence matches
    ref = [_seq([1, 5], [{1: -0.5, 2: -0.6}, {5: -0.1}]) for _ in range(4)]
    ours = [_seq([2, 5], [{2: -0.5, 1: -0.6}, {5: -0.1}]) for _ in range(4)]
    with pytest.raises(AssertionError, match="only 0/4 sequences match exactly"):
        check_greedy_close(ref, ours, topk=2, min_exact_fraction=0.5)


def test_check_greedy_close_rejects_logprob_drift_on_matching_tokens() -> None:
    ref = [_seq([1, 2], [{1: -0.1}, {2: -0.2}])]
    ours = [_seq([1, 2], [{1: -0.1}, {2: -0.25}])]
    with pytest.raises(AssertionError, match="pos 1: token 2 logprob"):
        check_greedy_close(ref, ours, topk=1, logprob_atol=1e-3)


def test_check_greedy_close_rejects_a_far_from_tied_divergence() -> None:
    ref = [_seq([1], [{1: -0.1, 2: -2.5}])]
    ours = [_seq([2], [{2: -0.1, 1: -2.5}])]
    with pytest.raises(AssertionError, match="not a near-tie"):
        check_greedy_close(ref, ours, topk=2, min_exact_fraction=0.0, max_divergence_gap=0.01)


# ---------------------------------------------------------------- tiny models of every family


def _tiny_prompts(tokenizer) -> list[list[int]]:
    """Random ids of varied lengths (1 token; under, across and far past the 32-token sliding
    window and the 64-token step budget) plus real text, English and non-ASCII."""
    g = torch.Generator().manual_seed(1234)
    random_ids = [torch.randint(0, tokenizer.vocab_size, (n,), generator=g).tolist() for n in (1, 17, 75, 160)]
    return random_ids + [tokenizer.encode(t) for t in TEXT_PROMPTS]


def test_tiny_models_greedy_match_transformers(tiny_model_dir: Path) -> None:
    llm = LLM(
        model=str(tiny_model_dir),
        max_model_len=512,
        max_num_batched_tokens=64,
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
        num_gpu_blocks_override=96,
        block_size=16,
        dtype="float32",
    )
    prompts = _tiny_prompts(llm.get_tokenizer())
    assert len(prompts) == 6 and min(map(len, prompts)) == 1 and max(map(len, prompts)) == 160

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(32), use_tqdm=False)
    ref = hf_greedy(tiny_model_dir, prompts, max_new_tokens=32, topk=TOPK)

    assert all(o.num_cached_tokens == 0 for o in outs)  # prefix caching is off
    check_greedy_close(
        ref,
        [o.outputs[0] for o in outs],
        TOPK,
        logprob_atol=LOGPROB_ATOL,
        min_exact_fraction=0.8,
        max_divergence_gap=MAX_DIVERGENCE_GAP,
        names=("transformers", "pagedllm"),
    )


# ---------------------------------------------------------------- the embedded SmolLM2 GGUF

_VILLAGES = [
    "Ashford",
    "Brindle",
    "Corwen",
    "Dunmore",
    "Elmstead",
    "Fairholm",
    "Glenrock",
    "Hartwell",
    "Ivybridge",
    "Juniper",
    "Kestrel",
    "Larkspur",
    "Millbrook",
    "Northwood",
    "Oakridge",
    "Pinecrest",
    "Queensfield",
    "Rosedale",
    "Stonehaven",
    "Thornbury",
    "Upton",
    "Valewood",
    "Westbrook",
]
LONG_STORY = (
    " ".join(
        f"Chapter {i}. The river flowed past the village of {name}, where the baker sold {3 + 4 * i} loaves of "
        "bread every morning and the children counted the boats."
        for i, name in enumerate(_VILLAGES)
    )
    + " Summarize the story so far:"
)

SMOLLM2_TEXTS = [
    "The capital of France is",
    "Hi",
    "La tour Eiffel a été construite pour l'Exposition universelle de 1889. Où se trouve-t-elle, "
    "et pourquoi était-elle controversée à l'époque ?",
    "请用中文简单介绍一下长城的历史。",
    "I love pizza 🍕 and tacos 🌮! My favourite emoji is 🙂 because",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    LONG_STORY,
]


@pytest.mark.slow
def test_smollm2_gguf_greedy_matches_transformers(smollm2_hf_model) -> None:
    llm = LLM(
        max_model_len=1024,
        max_num_batched_tokens=256,
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
        num_gpu_blocks_override=160,
        block_size=16,
        dtype="float32",
        quantization="gguf-exact",  # the file's blocks, float32 activations: transformers' function
    )
    tok = llm.get_tokenizer()
    chat = llm.apply_chat_template([{"role": "user", "content": "What is the boiling point of water?"}])
    prompts = [tok.encode(t) for t in SMOLLM2_TEXTS] + [chat]
    lengths = sorted(map(len, prompts))
    assert len(prompts) >= 8 and lengths[0] <= 2 and lengths[-1] > 600, lengths

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(48), use_tqdm=False)
    ref = hf_greedy(smollm2_hf_model, prompts, max_new_tokens=48, topk=TOPK)

    check_greedy_close(
        ref,
        [o.outputs[0] for o in outs],
        TOPK,
        logprob_atol=LOGPROB_ATOL,
        min_exact_fraction=0.75,
        max_divergence_gap=MAX_DIVERGENCE_GAP,
        names=("transformers", "pagedllm"),
    )
