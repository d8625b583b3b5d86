"""The float32 CPU hot path: linears through oneDNN with weights packed at load
(pagedllm/layers/linear.py) and the fused elementwise kernels (pagedllm/kernels/elementwise.c)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, SamplingParams, kernels
from pagedllm.layers import linear
from pagedllm.layers.linear import PackedLinear, onednn_available
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import apply_rotary

from utils import GreedyResult, check_greedy_close, kernels_at

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("n", [576, 37])
def test_fused_add_rms_norm_matches_torch(rows, n):
    g = torch.Generator().manual_seed(n + rows)
    norm = RMSNorm(n, eps=1e-5)
    norm.weight.data = torch.randn(n, generator=g)
    norm.requires_grad_(False)
    x, res = torch.randn(rows, n, generator=g) * 3, torch.randn(rows, n, generator=g)
    want_sum = x + res
    want = norm.weight * want_sum * torch.rsqrt(want_sum.pow(2).mean(-1, keepdim=True) + 1e-5)
    xc = x.clone()
    out, new_res = norm(xc, res)
    assert new_res.data_ptr() == xc.data_ptr()  # the fused kernel ran: the sum landed in x
    torch.testing.assert_close(new_res, want_sum)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    alone = norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm(x), alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norm(x.t().contiguous().t()), alone, rtol=1e-5, atol=1e-5)  # strided: torch path


@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("inter", [1536, 13])
def test_fused_silu_mul_matches_torch(rows, inter):
    g = torch.Generator().manual_seed(inter + rows)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, -30.0, 0.0])  # past the exp polynomial's clamps
    gate, up = gate_up.split(inter, dim=-1)
    torch.testing.assert_close(kernels.load().silu_mul(gate_up), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 20])
def test_fused_rotary_matches_torch(tokens):
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 7 * 32, generator=g)
    x = qkv[:, : 5 * 32].view(tokens, 5, 32)  # rows strided, as the fused projection's q|k view is
    ang = torch.rand(tokens, 1, 16, generator=g) * 6
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x.chunk(2, dim=-1)
    want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    got = apply_rotary(x, cos, sin)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_rotary_tables_are_a_steps_own_and_equal_transformers_bit_for_bit():
    """cos and sin are computed for a step's positions, not kept for every position the model allows (Qwen2.5's
    32,768 positions were 16 MiB of tables): the same bits as transformers' at any step length and start."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters

    cfg = Qwen2Config(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, rope_theta=1e6)
    assert cfg.max_position_embeddings == 32768
    ours, theirs = RotaryEmbedding(128, rope_parameters(cfg)), Qwen2RotaryEmbedding(cfg)
    held = [v for v in vars(ours).values() if isinstance(v, torch.Tensor)]
    assert sum(t.numel() for t in held) == 64  # inv_freq alone
    for steps, start in [(1, 0), (1, 32767), (7, 1000), (513, 5), (2048, 30720)]:
        positions = torch.arange(start, start + steps)
        cos, sin = ours.cos_sin(positions)
        assert cos.shape == sin.shape == (steps, 1, 64) and cos.is_contiguous()
        want_cos, want_sin = theirs(torch.zeros(1, steps, 256), positions[None])
        assert torch.equal(cos[:, 0], want_cos[0, :, :64]) and torch.equal(sin[:, 0], want_sin[0, :, :64])

    # Qwen2-VL's M-RoPE: frequency j turns with position component section_of[j] of [3, T] positions
    from pagedllm.models.qwen2_vl import MRotaryEmbedding

    mrope = MRotaryEmbedding(128, {**rope_parameters(cfg), "mrope_section": [16, 24, 24]})
    positions = torch.randint(0, 32768, (3, 300), generator=torch.Generator().manual_seed(0))
    cos, sin = mrope.cos_sin(positions)
    assert cos.shape == sin.shape == (300, 1, 64) and cos.is_contiguous() and sin.is_contiguous()  # the C rotary's
    each = [ours.cos_sin(p) for p in positions]  # [T, 1, 64] per component
    for got, k in ((cos, 0), (sin, 1)):
        want = torch.stack([c[k][:, 0] for c in each]).gather(0, mrope.section_of.expand(300, -1)[None])[0]
        assert torch.equal(got[:, 0], want)


@needs_onednn
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
    return [
        GreedyResult(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
        for o in outs
    ]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return set()


@needs_onednn
@pytest.mark.parametrize("n,k", [(37, 2080), (16, 33), (1, 1024), (960, 576), (64, 64), (49152, 576)])
def test_float32_gemv_sums_exactly_as_onednn(n, k):
    """A decode row through PackedLinear's own kernel (up to GEMV_ROWS rows) gets oneDNN's bits, so a
    row's logits do not depend on its batch; NaN propagates; zero rows work. Shapes: ragged panels, K
    tails, two K blocks, one output (oneDNN's own order differs there: the kernel must stand aside),
    a tiny test model's, SmolLM2's."""
    torch.manual_seed(n + k)
    lin = PackedLinear(torch.randn(n, k), torch.randn(n), gemv=True)
    if n == 960 and "avx512f" not in _cpu_flags():  # SmolLM2's qkv on AVX2 CPUs: the kernel is taken
        assert lin.panels is not None  # (oneDNN's AVX-512 kernels sum K=576 in another order: it stands aside)
    x = torch.randn(9, k)
    x[2, k // 2] = float("nan")
    full = linear.onednn_linear(x, lin.packed, lin.bias)
    for m in range(linear.GEMV_ROWS + 1):
        assert torch.equal(lin(x[:m]).nan_to_num(7.0), full[:m].nan_to_num(7.0)), m
    assert lin(x[:3])[2].isnan().all()
    assert lin(x[:0]).shape == (0, n)
    if lin.panels is not None:  # the kernel itself takes any row count, in blocks of 4 (65: one left over)
        x65 = torch.randn(65, k)
        assert torch.equal(kernels.load().f32_matmul(x65, lin.panels, n), linear.onednn_linear(x65, lin.packed, None))


@needs_onednn
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


@pytest.mark.parametrize("name", ["llama", "mistral"])  # mistral: a sliding window of 32 tokens
def test_prefills_take_the_attention_kernel(tiny_model_factory, monkeypatch, name):
    """Whole prompts (their own K/V) and prefill chunks after cached tokens (K/V from the paged cache) go
    through the C prefill kernel, never SDPA, with the greedy tokens and logprobs of the torch reference."""
    from pagedllm.attention import cpu_paged, torch_ref

    model = str(tiny_model_factory(name))
    prompts = [[(31 * i + 5 * j) % 4000 + 50 for j in range(9 + 23 * i)] for i in range(5)]  # 9 .. 101 tokens
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)

    def greedy() -> list[GreedyResult]:
        llm = LLM(model=model, num_gpu_blocks_override=64, max_num_batched_tokens=40, enable_prefix_caching=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [
            GreedyResult(
                o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]
            )
            for o in outs
        ]

    def no_sdpa(*args, **kwargs):
        raise AssertionError("a prefill took the SDPA reference path")

    with monkeypatch.context() as m:
        m.setattr(torch_ref, "_prefill", no_sdpa)
        ours = greedy()
    monkeypatch.setattr(cpu_paged, "kernel_applies", lambda *args: False)  # every attention through torch
    check_greedy_close(
        greedy(), ours, topk=5, logprob_atol=1e-4, min_exact_fraction=1.0, names=("torch reference", "C kernels")
    )


def test_kernels_propagate_nan_as_torch_does():
    """The vector exp keeps NaN (clamping must not turn it into a finite weight)."""
    k = kernels.load()
    cache = torch.randn(2, 4, 16, 1, 64)
    q = torch.full((1, 1, 64), float("nan"))
    table, start = torch.tensor([[0, 1]]), torch.zeros(1, dtype=torch.long)
    for seq_len in (16, 17):  # all eight-wide, and with a scalar tail
        assert k.paged_decode_attention(q, cache, table, torch.tensor([seq_len]), start, 0.1).isnan().all()
    gate_up = torch.ones(1, 32)
    gate_up[0, 3] = float("nan")
    assert k.silu_mul(gate_up).isnan().tolist() == [[i == 3 for i in range(16)]]


_FUSED_PROMPTS = [[(31 * i + 7 * j) % 4000 + 50 for j in range(3 + 11 * i)] for i in range(10)]


def _greedy_varied(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Ten prompts finishing at different lengths: steps of more decode rows than the C loop takes
    (Python), then fewer (C), within one run."""
    sps = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True, logprobs=3) for i in range(10)]
    outs = llm.generate([{"prompt_token_ids": p} for p in _FUSED_PROMPTS], sps, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]) for o in outs
    ]


@pytest.mark.parametrize(
    "name,method,kv",
    [
        ("llama", "int4", "auto"),
        ("qwen2", "w4a8", "auto"),
        ("mistral", "int8", "auto"),
        ("llama", "w4a8", "auto"),
        ("mistral", "w4a16", "auto"),
        ("qwen2", None, "auto"),
        ("mistral", None, "auto"),
        ("mistral", "w4a16", "bfloat16"),
        ("qwen2", None, "bfloat16"),
        ("mistral", "w4a8", "int8"),
        ("qwen2", None, "int8"),
    ],
)
# biases (qwen2), a sliding window (mistral), float32 (None: PackedLinear's own GEMV for up to 4 rows), a
# bfloat16 KV cache (the C loop rounds the new K/V as torch's .to(bfloat16) does), an int8 one (the C loop writes
# the bytes attention.kv_int8.quantize writes)
def test_fused_decode_loop_is_the_python_loop_bit_for_bit(tiny_model_factory, name, method, kv):
    """A decode-only step of a quantized model runs its layers in one C call: the very tokens and logprobs
    (exactly equal) of the Python loop (enforce_eager), and it falls back when a module is swapped."""
    from pagedllm.layers.quantization import dequantize_model

    model = str(tiny_model_factory(name))
    kw = dict(model=model, num_gpu_blocks_override=64, quantization=method, kv_cache_dtype=kv)
    eager = _greedy_varied(LLM(enforce_eager=True, **kw))
    llm = LLM(**kw)
    fused = llm.llm_engine.core.runner.model.fused_decode
    assert _greedy_varied(llm) == eager
    assert fused.steps >= (20 if method else 10)  # when 8 rows are left (the quantized kernels take 8, float32 4)
    steps = fused.steps
    net = llm.llm_engine.core.runner.model
    if method:
        dequantize_model(net)  # plain float32 nn.Linear: the C loop no longer applies
    else:
        net.layers[1].mlp.down_proj = torch.nn.Linear(
            net.layers[1].mlp.down_proj.in_features, net.layers[1].mlp.down_proj.out_features, bias=False
        )
    _greedy_varied(llm)
    assert fused.steps == steps


def _six_bit_per_16(lin: torch.nn.Module) -> torch.nn.Module:
    """An int8 linear in GGUF's Q6_K layout (-32..31, a scale per 16 weights) holding ``lin``'s weights."""
    from pagedllm.layers.quantization import Int8Linear

    w, bias = lin.dequantized()
    n, k = w.shape
    g = w.view(n, k // 16, 16)
    s = g.abs().amax(-1) / 31
    q = torch.round(g / torch.where(s > 0, s, 1)[..., None]).clamp(-32, 31).to(torch.int8).view(n, k)
    return Int8Linear(q, s, torch.zeros(n, k // 32), bias)


def test_fused_decode_loop_runs_a_scale_per_16_bit_for_bit(tiny_model_factory):
    """Down projections with a scale per 16 (a Q6_K tensor kept as it is) run in the C loop too, with the
    Python loop's very tokens and logprobs."""
    model = str(tiny_model_factory("llama"))
    llms = [
        LLM(model=model, num_gpu_blocks_override=64, quantization="int8", enforce_eager=eager)
        for eager in (True, False)
    ]
    for llm in llms:
        for layer in llm.llm_engine.core.runner.model.layers:
            layer.mlp.down_proj = _six_bit_per_16(layer.mlp.down_proj)
    assert _greedy_varied(llms[1]) == _greedy_varied(llms[0])
    assert llms[1].llm_engine.core.runner.model.fused_decode.steps >= 20


@pytest.mark.parametrize("name", ["qwen3", "mixtral"])  # q/k norms; MoE blocks
def test_fused_decode_loop_leaves_other_models_to_python(tiny_model_factory, name):
    llm = LLM(model=str(tiny_model_factory(name)), num_gpu_blocks_override=64, quantization="int4")
    _greedy_varied(llm)
    assert llm.llm_engine.core.runner.model.fused_decode.steps == 0


# 3, 7 and 8 query heads a kv head: one pass of the decode's rows, then two; AVX2's weighted V takes a token's rows
# 3 or 2 at a time (7: 2 + 3 + 2, 8: 3 + 3 + 2)
@pytest.mark.parametrize("heads", [6, 14, 16])
@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_query_row_gets_the_same_attention_bits_however_its_prompt_was_cut(window, kv_dtype, heads):
    """The decode kernel and the prefill kernel (a whole prompt on its own K / V, or a chunk after cached tokens
    read from the paged cache) walk a row's keys in the same tiles and sums: each token's attention has the same
    bits whether it was prefilled whole, chunked at any boundary (a one-token last chunk included) or decoded.
    A narrower cache is read by the whole prompt too, rounded as the chunks and decodes read it."""
    _check_cuts(kernels.load(), kv_dtype, window, heads)


@pytest.mark.parametrize("level", kernels.isa.machine_levels())
def test_int8_cache_attention_at_every_level(level):
    """An int8 cache's scores are integer sums at every level (AVX-512 VNNI, AVX-VNNI, AVX2's byte-pair products,
    plain C): each level gives a query row the same bits however its prompt was cut, and attention over the
    cache's values with the query rounded as a cache row is."""
    from pagedllm.attention import kv_int8

    with kernels_at(level) as kern:
        q, cache, table, whole = _check_cuts(kern, torch.int8, None, 6)
        n, _, d = q.shape
        pos = torch.arange(n)
        kv = kv_int8.widen(cache[:, table[pos // 16], pos % 16], torch.float32)  # [2, n, kvh, d]
        ref = F.scaled_dot_product_attention(
            kv_int8.round_query(q, d**-0.5).transpose(0, 1)[None],
            kv[0].transpose(0, 1)[None],
            kv[1].transpose(0, 1)[None],
            is_causal=True,
            scale=1.0,
            enable_gqa=True,
        )
        torch.testing.assert_close(whole, ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def _check_cuts(kern, kv_dtype, window, heads):
    """The cut-prompt checks on the kernels loaded (``kern``): (q, cache, table, the whole prompt's attention)."""
    from pagedllm.attention import cpu_paged, kv_int8, torch_ref

    torch.manual_seed(3)
    n, h, kvh, d, bs = 75, heads, 2, 64, 16
    q, k, v = torch.randn(n, h, d), torch.randn(n, kvh, d), torch.randn(n, kvh, d)
    blocks = (n + bs - 1) // bs
    table = torch.randperm(blocks + 3)[:blocks].to(torch.int64)  # blocks anywhere in the cache
    cache = torch.zeros(2, blocks + 3, bs, kvh, kv_int8.row_width(d, kv_dtype), dtype=kv_dtype)
    slots = table[torch.arange(n) // bs] * bs + torch.arange(n) % bs
    torch_ref.write_kv(k, v, cache, slots)
    scale = d**-0.5
    whole = torch.empty_like(q)
    assert cpu_paged._prefill(q, k, v, cache, table, 0, scale, window, whole)  # the backend's whole prompt
    for cuts in ([0, 16, 32, 75], [0, 24, 50, 74, 75], [0, 1, 2, 40, 75], [0, 37, 74, 75]):
        chunked = torch.empty_like(q)
        for a, b in itertools.pairwise(cuts):
            kern.paged_prefill_attention(q[a:b], cache, table, a, scale, window, chunked[a:b])
        assert torch.equal(chunked, whole), cuts
    for pos in (0, 15, 16, 40, 74):  # the token at pos decoded with pos earlier tokens in the cache
        start = max(0, pos + 1 - window) if window else 0
        lens, starts = torch.tensor([pos + 1]), torch.tensor([start])
        got = kern.paged_decode_attention(q[pos : pos + 1], cache, table[None], lens, starts, scale)
        assert torch.equal(got[0], whole[pos]), pos
    # several requests in one call (then a task takes all of a request's kv heads)
    pos = torch.tensor([0, 15, 16, 40, 74, 33])
    starts = (pos + 1 - window).clamp(min=0) if window else torch.zeros_like(pos)
    tables = table[None].expand(len(pos), -1).contiguous()
    got = kern.paged_decode_attention(q[pos].contiguous(), cache, tables, pos + 1, starts, scale)
    assert torch.equal(got, whole[pos])
    return q, cache, table, whole
