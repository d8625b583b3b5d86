"""`pagedllm bench throughput|latency` run both engines side by side and report their ratio."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _bench(args, tmp_path, progress: str = "it"):
    """Run a bench command; it must show a progress bar (tqdm on stderr) and write its JSON report."""
    out = tmp_path / "r.json"
    r = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", *args, "--output-json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "100%|" in r.stderr and progress in r.stderr, r.stderr[-2000:]
    return json.loads(out.read_text())


def test_bench_throughput_compares_with_transformers(tiny_model_factory, tmp_path):
    model = str(tiny_model_factory("llama"))
    res = _bench(
        [
            "throughput",
            "--model",
            model,
            "--num-prompts",
            "5",
            "--min-input-len",
            "8",
            "--max-input-len",
            "40",
            "--output-len",
            "6",
        ],
        tmp_path,
    )
    assert res["workload"]["output_tokens"] == 30 and 5 * 8 <= res["workload"]["prompt_tokens"] <= 5 * 40
    assert res["pagedllm"]["total_tok_s"] > 0 and res["transformers"]["total_tok_s"] > 0
    assert res["ratio_total_tok_s"] == res["pagedllm"]["total_tok_s"] / res["transformers"]["total_tok_s"]
    assert res["vs_transformers"] == {"greedy_agreement": 1.0, "identical_sequences": "5/5"}


def test_bench_throughput_hybrid_vs_off_frees_local_blocks_in_the_same_memory(tiny_model_factory, tmp_path):
    """Tiny Gemma 3 (a 32-token window): the same requests in the same KV memory, local layers freeing their
    blocks behind the window and keeping them; the same tokens, and fewer preemptions with the blocks freed."""
    model = str(tiny_model_factory("gemma3"))
    res = _bench(
        [
            "throughput",
            "--model",
            model,
            "--backend",
            "hybrid-vs-off",
            "--num-prompts",
            "8",
            "--input-len",
            "40",
            "--output-len",
            "200",
            "--kv-cache-memory",
            "0.001",
        ],
        tmp_path,
    )
    hybrid, off = res["pagedllm_hybrid"], res["pagedllm_all_blocks"]
    assert hybrid["total_tok_s"] > 0 and off["total_tok_s"] > 0
    assert res["hybrid_vs_all_blocks"] == {"greedy_agreement": 1.0, "identical_sequences": "8/8"}
    assert off["preemptions"] > hybrid["preemptions"]


def test_bench_startup_times_cold_and_warm_beside_transformers(tiny_model_factory, tmp_path):
    model = str(tiny_model_factory("llama"))
    res = _bench(["startup", "--model", model], tmp_path, progress="start-up runs")
    for name in ("pagedllm_cold", "pagedllm_warm", "transformers"):
        assert res[name]["first_token_s"] > 0, name
    for name in ("pagedllm_cold", "pagedllm_warm"):
        stages = res[name]["stages_s"]
        assert {"config", "tokenizer", "weights", "kv_cache"} <= set(stages), stages
        assert res[name]["engine_ready_s"] >= sum(stages.values()) - 1e-6
    assert res["cold_vs_transformers"] == res["pagedllm_cold"]["first_token_s"] / res["transformers"]["first_token_s"]


def test_bench_latency_reports_ttft_and_decode_speed(tiny_model_factory, tmp_path):
    model = str(tiny_model_factory("llama"))
    res = _bench(
        [
            "latency",
            "--model",
            model,
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--num-iters",
            "2",
            "--num-iters-warmup",
            "1",
        ],
        tmp_path,
    )
    for backend in ("pagedllm", "transformers"):
        assert len(res[backend]["ttft_ms"]) == 2 and res[backend]["median_decode_tok_s"] > 0
    assert res["ratio_decode_tok_s"] > 0


def test_bench_accuracy_reports_agreement_and_perplexity(tiny_model_factory, tmp_path):
    model = str(tiny_model_factory("llama"))
    res = _bench(
        ["accuracy", "--model", model, "--num-prompts", "3", "--output-len", "8", "--kv-cache-dtype", "bfloat16"],
        tmp_path,
    )
    assert res["config"] == {"quantization": None, "kv_cache_dtype": "bfloat16"}
    assert 0.0 <= res["greedy_agreement"] <= res["same_top_token"] <= 1.0
    assert 1 < res["perplexity_float32"] < float("inf")  # random weights: far worse than uniform, but finite
    assert abs(res["perplexity"] - res["perplexity_float32"]) / res["perplexity_float32"] < 0.05


def test_bench_accuracy_scores_long_prompts_against_another_kv_cache_dtype(tiny_model_factory, tmp_path):
    """--context-lengths: one prompt of code per length, scored at every position by the engine and by the same
    engine with the reference cache dtype; the same dtype on both sides gives the very same scores."""
    model = str(tiny_model_factory("llama"))
    common = ["accuracy", "--model", model, "--context-lengths", "100,600", "--reference-kv-cache-dtype", "bfloat16"]
    res = _bench([*common, "--kv-cache-dtype", "int8"], tmp_path)
    assert res["config"]["kv_cache_dtype"] == "int8" and res["reference_kv_cache_dtype"] == "bfloat16"
    assert set(res["lengths"]) == {"100", "600"}
    for row in res["lengths"].values():
        assert 0.5 < row["same_top_token"] <= 1.0
        assert abs(row["perplexity"] - row["perplexity_reference"]) / row["perplexity_reference"] < 0.05
    same = _bench([*common, "--kv-cache-dtype", "bfloat16"], tmp_path)["lengths"]
    assert all(r["same_top_token"] == 1.0 and r["perplexity"] == r["perplexity_reference"] for r in same.values())


def test_teacher_forced_tops_are_the_greedy_choices_along_a_continuation(tiny_model_factory):
    """Read back along its own greedy continuation, an engine ranks each next token first; along a
    continuation of other tokens, the firsts are what it would have chosen there, not that text."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.offline import teacher_forced_tops

    llm = LLM(model=str(tiny_model_factory("llama")), enable_prefix_caching=False, max_num_batched_tokens=32)
    prompts = [[5, 6, 7, 8, 9] * 3, list(range(100, 140))]
    outs = [
        o.outputs[0].token_ids
        for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
            use_tqdm=False,
        )
    ]
    assert teacher_forced_tops(llm, prompts, outs) == outs
    other = [[(t + 1) % 1000 for t in o] for o in outs]
    tops = teacher_forced_tops(llm, prompts, other)
    assert [t[0] for t in tops] == [o[0] for o in outs] and tops != other


def test_greedy_agreement_counts_tokens_before_the_first_divergence():
    from pagedllm.benchmarks.offline import greedy_agreement

    res = greedy_agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert res == {"greedy_agreement": 6 / 8, "identical_sequences": "1/2"}


# -- optional packages: checked before any work ---------------------------------------------------------


def _missing(monkeypatch, *modules: str) -> None:
    """importlib.util.find_spec finds none of ``modules`` (the others as installed); loading a tokenizer, an
    engine or transformers' model fails the test."""
    import importlib.util

    import transformers

    from pagedllm import model_loader
    from pagedllm.engine.llm_engine import LLMEngine

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in modules else real(name, *a))

    def loaded(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded before the optional packages were checked")

    monkeypatch.setattr(model_loader, "load_tokenizer", loaded)
    monkeypatch.setattr(LLMEngine, "__init__", loaded)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loaded)


def test_bench_latency_without_accelerate_says_so_in_one_line_before_any_model_loads(monkeypatch):
    from pagedllm.entrypoints.cli import main

    _missing(monkeypatch, "accelerate")
    with pytest.raises(SystemExit) as e:
        main(["bench", "latency"])  # the default model is a GGUF
    assert e.value.code == (
        "pagedllm bench latency compares against transformers, which needs accelerate to load a GGUF: "
        'pip install -e ".[bench]"'
    )


@pytest.mark.parametrize(
    "args, missing",
    [
        (["throughput"], ("accelerate",)),
        (["latency", "--backend", "transformers"], ("accelerate",)),
        (["startup"], ("accelerate",)),
        (["throughput", "--backend", "structured-vs-off"], ("xgrammar", "llguidance")),
        (["embed"], ("sentence_transformers",)),
        (["serve"], ("httpx",)),
        (["soak"], ("httpx",)),
    ],
)
def test_benches_check_their_optional_packages_before_any_model_loads(monkeypatch, args, missing):
    from pagedllm.entrypoints.cli import main

    _missing(monkeypatch, *missing)
    with pytest.raises(SystemExit) as e:
        main(["bench", *args])
    message = e.value.code
    assert isinstance(message, str) and "\n" not in message, message
    assert all(m in message for m in missing) and "pip install" in message, message


def test_bench_latency_writes_pagedllm_results_before_transformers_runs(monkeypatch, tmp_path, capsys):
    """transformers failing anyway (here: at once) leaves the pagedllm half on stderr and in --output-json."""
    from pagedllm.benchmarks import offline
    from pagedllm.entrypoints.cli import main

    def fake_latency(model, input_len, output_len, iters, warmup, backend, kwargs, dataset):
        if backend == "transformers":
            raise RuntimeError("transformers failed")
        return {"median_ttft_ms": 1.0, "median_decode_tok_s": 2.0, "outputs": [[1, 2]]}

    monkeypatch.setattr(offline, "run_latency", fake_latency)
    out = tmp_path / "r.json"
    with pytest.raises(RuntimeError, match="transformers failed"):
        main(["bench", "latency", "--output-json", str(out)])
    assert json.loads(out.read_text())["pagedllm"] == {"median_ttft_ms": 1.0, "median_decode_tok_s": 2.0}
    assert 'pagedllm: {"median_ttft_ms": 1.0, "median_decode_tok_s": 2.0}' in capsys.readouterr().err
