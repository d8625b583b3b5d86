"""The engine on a CUDA device: what the CPU suite proves of the scheduler and cache, checked where a GPU is.

Skipped where torch sees no CUDA device, as on CI's machines; docs/development.md gives the command for a GPU
machine. Tiny random-weight models (tests/utils.py), float32 where outputs are compared to the bit, so that
any difference comes from the engine's paths and not from bfloat16 rounding; test_fidelity.py's comparison
with transformers runs on the device too (``device="auto"`` picks CUDA)."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams

from utils import check_engine_clean, check_greedy_close, check_outputs_unchanged

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
F32 = dict(dtype="float32", max_model_len=512)


@pytest.fixture(scope="module")
def tiny(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    rng = random.Random(0)
    shared = [rng.randrange(100, 40000) for _ in range(70)]
    alone = [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 120))] for _ in range(10)]
    sharing = [shared + [rng.randrange(100, 40000) for _ in range(rng.randint(5, 40))] for _ in range(6)]
    return [{"prompt_token_ids": p} for p in alone + sharing]


@pytest.fixture(scope="module")
def reference(tiny, prompts) -> list:
    """Every feature off, a cache that holds everything at once."""
    llm = LLM(
        tiny,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_num_batched_tokens=4096,
        num_gpu_blocks_override=512,
        **F32,
    )
    assert llm.llm_engine.device.type == "cuda"
    return llm.generate(prompts, GREEDY, use_tqdm=False)


@pytest.mark.parametrize(
    "setting",
    [
        dict(max_num_batched_tokens=32, enable_prefix_caching=False, num_gpu_blocks_override=512),  # chunked
        dict(max_num_batched_tokens=64, num_gpu_blocks_override=512),  # prefix cache hits on the shared 70
        dict(max_num_batched_tokens=64, max_model_len=224, num_gpu_blocks_override=14),  # preemption
    ],
    ids=["chunked_prefill", "prefix_caching", "preemption"],
)
def test_scheduler_features_leave_outputs_unchanged_on_the_device(tiny, prompts, reference, setting):
    llm = LLM(tiny, **{**F32, **setting})
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.llm_engine.core.make_stats()
    if setting.get("num_gpu_blocks_override") == 14:
        assert stats.num_preemptions > 0
    elif setting.get("enable_prefix_caching", True):
        assert stats.prefix_cache.hits > 0
    check_outputs_unchanged(reference, outs)
    check_engine_clean(llm)


def test_n_samples_share_the_prompt_and_match_separate_seeded_requests(tiny):
    llm = LLM(tiny, num_gpu_blocks_override=256, **F32)
    prompt = {"prompt_token_ids": list(range(300, 360))}
    params = SamplingParams(n=4, temperature=1.0, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)
    together = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    again = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    assert together == again and len({tuple(t) for t in together}) > 1
    check_engine_clean(llm)


def test_the_default_dtype_is_bfloat16_and_follows_float32(tiny, prompts, reference):
    llm = LLM(tiny, max_model_len=512, num_gpu_blocks_override=512)
    assert llm.llm_engine.dtype == torch.bfloat16
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    # a random tiny model's next-token distribution is nearly flat (top logprobs about -5 over 49k tokens), so
    # bfloat16's rounding parts the greedy paths within a few tokens (on an H200: 0 of 16 the same to the end);
    # up to there each token is near float32's, and where they part each is in the other's top 5
    check_greedy_close(
        [o.outputs[0] for o in reference],
        [o.outputs[0] for o in outs],
        5,
        logprob_atol=0.3,
        min_exact_fraction=0.0,
        names=("float32", "bfloat16"),
    )


def test_a_failed_start_gives_its_memory_back_and_two_engines_share_the_device(tiny):
    """A start that fails after its KV cache was allocated (90% of the device by default) lets go of it while
    its error is held; gpu_memory_utilization is each engine's own share, as in vLLM."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    with pytest.raises(ValueError, match="max_num_batched_tokens") as e:
        LLM(tiny, enable_chunked_prefill=False, max_num_batched_tokens=64, **F32)
    assert e.value is not None  # held, with its traceback
    assert torch.cuda.memory_allocated() - before < 64 << 20
    total = torch.cuda.mem_get_info()[1]
    a = LLM(tiny, gpu_memory_utilization=0.3, **F32)
    b = LLM(tiny, gpu_memory_utilization=0.3, **F32)
    assert a.llm_engine.num_blocks > 0
    assert abs(a.llm_engine.num_blocks - b.llm_engine.num_blocks) <= 0.02 * a.llm_engine.num_blocks
    assert torch.cuda.memory_allocated() - before <= 0.62 * total
    for llm in (a, b):
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_cpu_only_quantization_is_refused_by_name_on_the_device(tiny):
    with pytest.raises(ValueError, match=r"quantization='int4'.*'cuda'"):
        LLM(tiny, quantization="int4", **F32)
