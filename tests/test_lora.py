"""Multi-LoRA: PEFT adapters built here with peft (random weights) must give what transformers + peft
gives with the same adapter on the same base model, alone and mixed in one batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidParameterError
from pagedllm.lora import LoRARequest

from utils import check_greedy_close, hf_greedy

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
PROMPTS = [
    "The quick brown fox jumps over",
    "In a hole in the ground there lived",
    "1, 2, 3, 4,",
    "Once upon a time, in a land far away",
]
MAX_TOKENS = 12


def build_adapter(
    base_dir: Path,
    out_dir: Path,
    r: int,
    targets: list[str],
    rslora: bool = False,
    seed: int = 0,
    alpha: int | None = None,
) -> Path:
    """A PEFT LoRA adapter with random (non-zero) A and B, saved as PEFT saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(
        base, LoraConfig(r=r, lora_alpha=alpha or 2 * r, target_modules=targets, use_rslora=rslora, lora_dropout=0.0)
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 / r**0.5))
    model.save_pretrained(out_dir)
    return out_dir


def peft_greedy(base_dir: Path, adapter_dir: Path | None, prompt_ids: list[list[int]]) -> list:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return hf_greedy(model, prompt_ids, MAX_TOKENS)


@pytest.fixture(scope="module")
def base_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")  # GQA, head_dim 32 != hidden / heads


@pytest.fixture(scope="module")
def adapters(base_dir: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "r8_attn": build_adapter(base_dir, root / "r8_attn", 8, ATTENTION, seed=1),
        "r8_all_rslora": build_adapter(base_dir, root / "r8_all_rslora", 8, ALL_LINEAR, rslora=True, seed=2),
        "r64_all": build_adapter(base_dir, root / "r64_all", 64, ALL_LINEAR, seed=3),
        "r16_mlp": build_adapter(base_dir, root / "r16_mlp", 16, ["gate_proj", "down_proj"], seed=4),
    }


@pytest.fixture(scope="module")
def llm(base_dir: Path) -> LLM:
    return LLM(
        str(base_dir), enable_lora=True, max_loras=4, max_lora_rank=64, max_model_len=256, num_gpu_blocks_override=64
    )


@pytest.fixture(scope="module")
def prompt_ids(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok(p).input_ids for p in PROMPTS]


def _ours(llm: LLM, prompt_ids: list[list[int]], loras: Any) -> list:
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompt_ids],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=5, ignore_eos=True),
        use_tqdm=False,
        lora_request=loras,
    )
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("name", ["r8_attn", "r8_all_rslora", "r64_all", "r16_mlp"])
def test_each_adapter_matches_transformers_with_peft(name: str, llm: LLM, base_dir: Path, adapters, prompt_ids) -> None:
    ref = peft_greedy(base_dir, adapters[name], prompt_ids)
    ours = _ours(llm, prompt_ids, LoRARequest(name, 1 + list(adapters).index(name), str(adapters[name])))
    result = check_greedy_close(ref, ours, topk=5, logprob_atol=1e-4, min_exact_fraction=1.0)
    assert result.num_exact == len(PROMPTS)
    base = _ours(llm, prompt_ids, None)
    assert [list(o.token_ids) for o in ours] != [list(o.token_ids) for o in base]  # the adapter does something


def test_one_batch_mixing_the_base_and_four_adapters_equals_each_alone(llm: LLM, adapters, prompt_ids) -> None:
    reqs = [None] + [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())]
    mixed_prompts = [ids for ids in prompt_ids for _ in reqs]
    mixed_loras = [r for _ in prompt_ids for r in reqs]
    mixed = _ours(llm, mixed_prompts, mixed_loras)
    for j, req in enumerate(reqs):
        alone = _ours(llm, prompt_ids, req)
        got = [mixed[i * len(reqs) + j] for i in range(len(prompt_ids))]
        assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in alone], req
        for a, b in zip(got, alone):
            assert max(abs(x[t].logprob - y[t].logprob) for t, x, y in zip(a.token_ids, a.logprobs, b.logprobs)) < 1e-4


def test_more_adapters_than_slots_queue_for_a_slot_and_all_finish(base_dir: Path, adapters, prompt_ids) -> None:
    """max_loras=2 with four adapters: at most two adapters run at once; every request still finishes with
    its own adapter's output."""
    small = LLM(
        str(base_dir),
        enable_lora=True,
        max_loras=2,
        max_lora_rank=64,
        max_cpu_loras=2,
        max_model_len=256,
        num_gpu_blocks_override=64,
    )
    reqs = [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())]
    loras = [r for r in reqs for _ in prompt_ids]
    got = _ours(small, [ids for _ in reqs for ids in prompt_ids], loras)
    seen = []
    core = small.llm_engine.core
    orig = core.scheduler.schedule

    def spy(*a, **k):
        out = orig(*a, **k)
        seen.append({r.lora_int_id for r in core.scheduler.running} - {0})
        return out

    core.scheduler.schedule = spy
    try:
        again = _ours(small, [ids for _ in reqs for ids in prompt_ids], loras)
    finally:
        core.scheduler.schedule = orig
    assert max(len(s) for s in seen) == 2 and len(set().union(*seen)) == 4
    assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in again]
    for i, req in enumerate(reqs):  # each equals the adapter alone in the 4-slot engine's reference run
        alone = _ours(small, prompt_ids, req)
        assert [list(o.token_ids) for o in got[i * len(prompt_ids) : (i + 1) * len(prompt_ids)]] == [
            list(o.token_ids) for o in alone
        ]


def test_prefix_cache_never_shares_kv_between_adapters(llm: LLM, adapters, prompt_ids) -> None:
    req = LoRARequest("r8_attn", 1, str(adapters["r8_attn"]))
    long_prompt = [prompt_ids[0] * 8]  # several full blocks
    base_first = _ours(llm, long_prompt, None)
    with_adapter = _ours(llm, long_prompt, req)
    assert with_adapter[0].token_ids != base_first[0].token_ids
    outs = llm.generate(
        [{"prompt_token_ids": long_prompt[0]}], SamplingParams(max_tokens=1), use_tqdm=False, lora_request=req
    )
    assert outs[0].num_cached_tokens > 0  # the same adapter does reuse its own blocks


def test_bad_adapters_and_requests_get_clear_errors(llm: LLM, base_dir: Path, adapters, tmp_path) -> None:
    with pytest.raises(InvalidParameterError, match="enable_lora"):
        LLM(str(base_dir), max_model_len=64, num_gpu_blocks_override=8).generate(
            ["hi"], lora_request=LoRARequest("a", 1, str(adapters["r8_attn"])), use_tqdm=False
        )
    with pytest.raises(InvalidParameterError, match=r"no adapter_config\.json"):
        llm.generate(["hi"], lora_request=LoRARequest("missing", 90, str(tmp_path)), use_tqdm=False)
    small_rank = LLM(str(base_dir), enable_lora=True, max_lora_rank=16, max_model_len=64, num_gpu_blocks_override=8)
    with pytest.raises(InvalidParameterError, match="rank 64 is above max_lora_rank=16"):
        small_rank.generate(["hi"], lora_request=LoRARequest("big", 3, str(adapters["r64_all"])), use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="already names adapter"):
        llm.generate(["hi"], lora_request=LoRARequest("other", 1, str(adapters["r64_all"])), use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, "/x")
    with pytest.raises(InvalidParameterError, match="lora_request has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], lora_request=[None], use_tqdm=False)
    # an adapter for another model shape: the shapes do not fit this base
    from utils import build_tiny_model

    other = build_tiny_model(tmp_path / "other", "qwen2")
    wrong = build_adapter(other, tmp_path / "wrong", 8, ATTENTION)
    with pytest.raises(InvalidParameterError, match="do not fit"):
        llm.generate(["hi"], lora_request=LoRARequest("wrong", 91, str(wrong)), use_tqdm=False)
    assert llm.generate(["still serving"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_server_selects_adapters_by_model_name_and_loads_them_at_run_time(llm: LLM, base_dir: Path, adapters) -> None:
    import httpx

    from utils import MODEL, Server

    def offline(path: Path, lora_id: int) -> str:
        out = llm.generate(
            [PROMPTS[1]],
            SamplingParams(max_tokens=8, temperature=0),
            use_tqdm=False,
            lora_request=LoRARequest("x", lora_id, str(path)),
        )
        return out[0].outputs[0].text

    srv = Server(
        str(base_dir),
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "64",
        "--lora-modules",
        f"sql={adapters['r8_attn']}",
        f"chat={adapters['r16_mlp']}",
        "--allow-runtime-lora-updating",
    )
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            models = c.get("/v1/models").json()["data"]
            assert [(m["id"], m["parent"]) for m in models] == [(MODEL, None), ("sql", MODEL), ("chat", MODEL)]

            def complete(model: str, **extra: Any) -> httpx.Response:
                return c.post(
                    "/v1/completions",
                    json={"model": model, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, **extra},
                )

            r = complete("sql")
            assert r.status_code == 200 and r.json()["model"] == "sql"
            assert r.json()["choices"][0]["text"] == offline(adapters["r8_attn"], 1)
            assert complete("chat").json()["choices"][0]["text"] == offline(adapters["r16_mlp"], 4)
            streamed = "".join(json_line["choices"][0]["text"] for json_line in _sse(complete("sql", stream=True)))
            assert streamed == offline(adapters["r8_attn"], 1)
            missing = complete("nope")
            assert missing.status_code == 404 and "nope" in missing.json()["error"]["message"]

            load = c.post("/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": str(adapters["r64_all"])})
            assert load.status_code == 200, load.text
            assert complete("new").json()["choices"][0]["text"] == offline(adapters["r64_all"], 3)
            again = c.post("/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": str(adapters["r64_all"])})
            assert again.status_code == 400
            bad = c.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"})
            assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
            assert c.post("/v1/unload_lora_adapter", json={"lora_name": "new"}).status_code == 200
            assert complete("new").status_code == 404
            assert c.post("/v1/unload_lora_adapter", json={"lora_name": "new"}).status_code == 404
            assert "bad" not in [m["id"] for m in c.get("/v1/models").json()["data"]]
            metrics = c.get("/metrics").text
            assert 'pagedllm:lora_requests_total{lora_name="sql",model_name="tiny"} 2.0' in metrics
            assert "pagedllm:lora_requests_info{" in metrics
            assert complete(MODEL).status_code == 200  # the base model is still served
    finally:
        srv.stop()


def _sse(resp: Any) -> list[dict]:
    import json

    return [
        json.loads(line[6:])
        for line in resp.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]" and '"choices":[]' not in line
    ]


def test_adapters_under_chunked_prefill_preemption_n_and_beam_search(base_dir: Path, adapters, prompt_ids) -> None:
    """A tiny cache and step budget (chunks, preemptions) and n=2 give each adapter's outputs unchanged;
    beam search runs every beam with the adapter."""
    from pagedllm.beam_search import BeamSearchParams

    reqs = [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())]
    kw = dict(enable_lora=True, max_loras=4, max_lora_rank=64, max_model_len=128)
    roomy = LLM(str(base_dir), num_gpu_blocks_override=128, **kw)
    tight = LLM(str(base_dir), num_gpu_blocks_override=12, max_num_batched_tokens=16, **kw)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, n=2)
    prompts = [{"prompt_token_ids": ids * 3} for ids in prompt_ids]
    loras = [reqs[i % len(reqs)] for i in range(len(prompts))]
    a = roomy.generate(prompts, params, use_tqdm=False, lora_request=loras)
    b = tight.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert tight.llm_engine.core.scheduler.num_preemptions > 0
    assert [[list(c.token_ids) for c in o.outputs] for o in a] == [[list(c.token_ids) for c in o.outputs] for o in b]
    assert all(o.outputs[0].token_ids == o.outputs[1].token_ids for o in a)  # greedy: both samples agree

    beams = roomy.beam_search([prompts[0]], BeamSearchParams(beam_width=2, max_tokens=4), lora_request=reqs[0])
    base_beams = roomy.beam_search([prompts[0]], BeamSearchParams(beam_width=2, max_tokens=4))
    assert beams[0].sequences[0].tokens != base_beams[0].sequences[0].tokens


@pytest.mark.slow
def test_smollm2_with_a_peft_adapter_matches_transformers(smollm2_hf_model, tmp_path) -> None:
    """The embedded SmolLM2 with a rank-8 all-linear adapter (rslora) against transformers + peft on a copy
    of transformers' own model of the same GGUF."""
    import copy

    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        copy.deepcopy(smollm2_hf_model),
        LoraConfig(r=8, lora_alpha=16, target_modules=ALL_LINEAR, use_rslora=True, lora_dropout=0.0),
    )
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(tmp_path / "adapter")
    llm = LLM(
        enable_lora=True, max_lora_rank=8, max_model_len=256, num_gpu_blocks_override=64, quantization="gguf-exact"
    )
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    ours = _ours(llm, prompts, LoRARequest("smol", 1, str(tmp_path / "adapter")))
    ref = hf_greedy(model.eval(), prompts, MAX_TOKENS)
    base = _ours(llm, prompts, None)
    # the base model alone agrees with transformers to 2e-4 on SmolLM2 (test_fidelity): the same bound here
    check_greedy_close(
        ref,
        ours,
        topk=5,
        logprob_atol=2e-4,
        min_exact_fraction=2 / 3,
        max_divergence_gap=1e-2,
        names=("transformers+peft", "pagedllm"),
    )
    assert [list(o.token_ids) for o in ours] != [list(o.token_ids) for o in base]


def test_loading_unloading_and_eviction_under_traffic_lose_no_request(llm: LLM, base_dir: Path, adapters) -> None:
    """One slot and one adapter in memory for three adapters and the base, with requests to all of them in
    flight while a fourth adapter is loaded and unloaded: every request answers, each with its adapter."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from utils import MODEL, Server

    names = {"a": ("r8_attn", 1), "b": ("r16_mlp", 4), "c": ("r8_all_rslora", 2)}
    want = {}
    for name, (key, lora_id) in names.items():
        out = llm.generate(
            [PROMPTS[2]],
            SamplingParams(max_tokens=6, temperature=0),
            use_tqdm=False,
            lora_request=LoRARequest(key, lora_id, str(adapters[key])),
        )
        want[name] = out[0].outputs[0].text
    want[MODEL] = (
        llm.generate([PROMPTS[2]], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0].outputs[0].text
    )
    srv = Server(
        str(base_dir),
        "--enable-lora",
        "--max-loras",
        "1",
        "--max-cpu-loras",
        "1",
        "--max-lora-rank",
        "64",
        "--lora-modules",
        *[f"{n}={adapters[k]}" for n, (k, _) in names.items()],
        "--allow-runtime-lora-updating",
    )
    try:
        order = [n for _ in range(6) for n in [*names, MODEL]]
        with httpx.Client(base_url=srv.url, timeout=120) as c, ThreadPoolExecutor(6) as pool:
            futures = [
                pool.submit(
                    c.post,
                    "/v1/completions",
                    json={"model": n, "prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0},
                )
                for n in order
            ]
            for _ in range(3):
                assert (
                    c.post(
                        "/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": str(adapters["r64_all"])}
                    ).status_code
                    == 200
                )
                assert c.post("/v1/unload_lora_adapter", json={"lora_name": "d"}).status_code == 200
            answers = [f.result() for f in futures]
        assert [r.status_code for r in answers] == [200] * len(order)
        assert [r.json()["choices"][0]["text"] for r in answers] == [want[n] for n in order]
    finally:
        srv.stop()


def test_speculative_decoding_keeps_each_adapters_outputs(base_dir: Path, adapters, prompt_ids) -> None:
    """n-gram drafts are verified by the target with its adapter: outputs equal those without drafting."""
    reqs = [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())]
    kw = dict(enable_lora=True, max_loras=4, max_lora_rank=64, max_model_len=256, num_gpu_blocks_override=64)
    spec = LLM(
        str(base_dir),
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 2,
            "prompt_lookup_min": 1,
        },
        **kw,
    )
    plain = LLM(str(base_dir), **kw)
    prompts = [{"prompt_token_ids": ids * 2} for ids in prompt_ids]  # repeats: n-gram finds drafts
    loras = [reqs[i % len(reqs)] for i in range(len(prompts))]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    a = spec.generate(prompts, params, use_tqdm=False, lora_request=loras)
    b = plain.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert [list(o.outputs[0].token_ids) for o in a] == [list(o.outputs[0].token_ids) for o in b]
    assert spec.llm_engine.core.scheduler.spec_stats.num_draft_tokens > 0


def test_an_mlp_with_lora_linears_takes_the_steps_rows_at_once(monkeypatch) -> None:
    """The MLP runs a long step's rows in runs of ``MLP_ROWS`` where its linears compute each row alone (GGUF
    panels; here two float ones said to), but a LoRA linear's row segments index the whole step's rows: an MLP
    holding one takes them at once, and its adapter reaches the rows it names."""
    from types import SimpleNamespace

    from pagedllm.layers import mlp
    from pagedllm.lora.layers import LoRALinear, LoRAState

    torch.manual_seed(0)
    block = mlp.GatedMLP(SimpleNamespace(hidden_size=8, intermediate_size=16, hidden_act="silu"))

    def reference(gate_up: torch.Tensor) -> torch.Tensor:
        return block.down_proj(torch.nn.functional.silu(gate_up[:, :16]) * gate_up[:, 16:])

    x = torch.randn(10, 8)
    rows: list[int] = []
    local = mlp.GatedMLP._local
    monkeypatch.setattr(mlp.GatedMLP, "_local", lambda self, x: rows.append(x.shape[0]) or local(self, x))
    monkeypatch.setattr(mlp, "MLP_ROWS", 4)
    torch.testing.assert_close(block(x), reference(block.gate_up_proj(x)))
    assert rows == [10]  # float linears: the step's rows at once
    block.gate_up_proj.rows_alone = block.down_proj.rows_alone = True
    rows.clear()
    torch.testing.assert_close(block(x), reference(block.gate_up_proj(x)))
    assert rows == [4, 4, 2]
    state = LoRAState()
    block.gate_up_proj = lora = LoRALinear(block.gate_up_proj, [16, 16], max_loras=1, max_rank=2, state=state)
    lora.set_slot(0, [(torch.randn(2, 8), torch.randn(16, 2)), None])  # the gate's adapter
    with state.active([(0, slice(6, 10))]):  # on the step's rows 6-9
        want = reference(lora(x))
        assert not torch.allclose(want[6:], reference(lora.base(x))[6:])  # the adapter changes those rows
        rows.clear()
        torch.testing.assert_close(block(x), want)
    assert rows == [10]
