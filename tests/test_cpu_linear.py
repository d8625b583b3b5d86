"""float32 CPU linears through oneDNN with weights packed at load (pagedllm/layers/linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from utils import GreedyResult, check_greedy_close

from pagedllm import LLM, SamplingParams
from pagedllm.layers import linear
from pagedllm.layers.linear import PackedLinear, onednn_available

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
def test_packed_linear_matches_f_linear(bias, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    layer = PackedLinear(w, b)
    x = torch.randn(rows, 40, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    xt = torch.randn(40, 3, 5, generator=g).permute(1, 2, 0)  # 3-D and not contiguous
    torch.testing.assert_close(layer(xt), F.linear(xt, w, b), rtol=1e-5, atol=1e-5)


def _greedy(llm: LLM) -> list[GreedyResult]:
    prompts = [[(29 * i + 7 * j) % 4000 + 50 for j in range(4 + 11 * i)] for i in range(5)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [GreedyResult(o.outputs[0].token_ids,
                         [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])  # biases, untied head / q-k norms, tied head
def test_packed_engine_matches_unpacked(tiny_model_factory, monkeypatch, name):
    """Every projection and the head (a packed copy of a tied embedding) go through oneDNN; greedy tokens
    and logprobs are those of the same engine on PyTorch's F.linear, up to summation order."""
    model = str(tiny_model_factory(name))
    packed = LLM(model=model, num_gpu_blocks_override=64)
    m = packed.llm_engine.core.runner.model
    assert isinstance(m.layers[0].self_attn.qkv_proj, PackedLinear)
    assert isinstance(m.layers[-1].mlp.down_proj, PackedLinear) and isinstance(m.lm_head, PackedLinear)
    got = _greedy(packed)
    del packed
    monkeypatch.setattr(linear, "onednn_available", lambda: False)
    plain = LLM(model=model, num_gpu_blocks_override=64)
    assert type(plain.llm_engine.core.runner.model.layers[0].self_attn.qkv_proj) is torch.nn.Linear
    check_greedy_close(_greedy(plain), got, topk=5, logprob_atol=1e-4, names=("F.linear", "oneDNN"))
