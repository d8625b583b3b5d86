"""Mixture of Experts (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE with a dense layer): tokens and
logprobs against transformers, experts run once per step (not per token), and quantized experts."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.distributed import ParallelState
from pagedllm.errors import UnsupportedModelError
from pagedllm.layers.fused_moe import FusedMoE, RouterLinear

from utils import check_greedy_close, hf_greedy

MOE = ["mixtral", "qwen2_moe", "qwen3_moe"]
PROMPTS = [[5, 17, 300, 4000, 9, 12], list(range(100, 190)), [42]]


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=48, **kw)


def _moe_layers(llm: LLM) -> list[FusedMoE]:
    return [m for m in llm.llm_engine.core.runner.model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("name", MOE)
def test_moe_matches_transformers_tokens_and_logprobs(tiny_model_factory, name):
    path = tiny_model_factory(name)
    llm = _llm(path)
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    ref = hf_greedy(path, PROMPTS, max_new_tokens=24, topk=5)
    cmp = check_greedy_close(
        ref,
        [o.outputs[0] for o in outs],
        5,
        logprob_atol=1e-4,
        min_exact_fraction=1.0,
        names=("transformers", "pagedllm"),
    )
    assert cmp is not None
    layers = _moe_layers(llm)
    expected_sparse = {"mixtral": 2, "qwen2_moe": 2, "qwen3_moe": 1}[name]  # qwen3_moe's layer 0 is dense
    assert len(layers) == expected_sparse
    assert (layers[0].shared_expert is not None) == (name == "qwen2_moe")


def test_each_expert_runs_once_per_step_not_once_per_token(tiny_model_factory):
    llm = _llm(tiny_model_factory("mixtral"), enable_prefix_caching=False)
    layers = _moe_layers(llm)
    steps0 = llm.llm_engine.core.runner.num_tokens_computed
    before = [m.expert_calls for m in layers]
    prompts = [list(range(1000 + 40 * i, 1040 + 40 * i)) for i in range(4)]  # 160 prompt tokens
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False
    )
    tokens = llm.llm_engine.core.runner.num_tokens_computed - steps0
    steps = len(llm.llm_engine.core.step_history)
    assert tokens >= 160
    for m, b in zip(layers, before):
        calls = m.expert_calls - b
        # at most one call per expert per step: 8 experts x a few steps, against 2 x 160 (token, expert) pairs
        assert 0 < calls <= m.num_experts * steps < m.top_k * tokens, (calls, steps, tokens)


def test_routing_sorts_tokens_by_expert_and_skips_empty_experts():
    class Cfg:
        hidden_size, intermediate_size, hidden_act = 16, 32, "silu"

    torch.manual_seed(0)
    moe = FusedMoE(Cfg, num_experts=6, top_k=2, intermediate_size=8, renormalize=True)
    for p in moe.parameters():
        p.data.normal_(0, 0.3)
    with torch.no_grad():
        moe.gate.weight[3:] = -100.0  # experts 3-5 never win against 0-2 for positive inputs
        x = torch.rand(50, 16)
        experts, weights = moe.route(x)
        assert set(experts.unique().tolist()) <= {0, 1, 2} and torch.allclose(weights.sum(-1), torch.ones(50))
        y = moe(x)
    assert moe.expert_calls == len(experts.unique())  # empty experts cost nothing
    want = torch.zeros_like(x)  # a token-by-token reference
    for t in range(50):
        for slot in range(2):
            want[t] += weights[t, slot] * moe.experts[int(experts[t, slot])](x[t : t + 1])[0]
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)


def test_int4_quantizes_the_experts_but_not_the_router(tiny_model_factory):
    """(tests/test_quantization.py checks the quantized MoE engines against their dequantized reference)"""
    from pagedllm.layers.quantization import Int4Linear

    llm = _llm(tiny_model_factory("qwen2_moe"), quantization="int4")
    layer = _moe_layers(llm)[0]
    assert isinstance(layer.experts[0].gate_up_proj, Int4Linear) and isinstance(layer.experts[5].down_proj, Int4Linear)
    assert isinstance(layer.shared_expert.down_proj, Int4Linear)
    for router in (layer.gate, layer.shared_expert_gate):  # routing decisions stay in float32
        assert type(router) is RouterLinear and router.weight.dtype == torch.float32


def test_tensor_parallel_moe_without_expert_parallel_is_refused_clearly():
    class Cfg:
        hidden_size, intermediate_size, hidden_act = 16, 32, "silu"

    with pytest.raises(UnsupportedModelError, match="needs enable_expert_parallel"):
        FusedMoE(Cfg, 4, 2, 8, True, ps=ParallelState(tp_size=2))
