"""`pagedllm bench throughput|latency` run both engines side by side and report their ratio."""

from __future__ import annotations

import json
import subprocess
import sys


def _bench(args, tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", *args, "--output-json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(out.read_text())


def test_bench_throughput_compares_with_transformers(tiny_model_factory, tmp_path):
    model = str(tiny_model_factory("llama"))
    res = _bench(["throughput", "--model", model, "--num-prompts", "5", "--min-input-len", "8",
                  "--max-input-len", "40", "--output-len", "6"], tmp_path)
    assert res["workload"]["output_tokens"] == 30 and 5 * 8 <= res["workload"]["prompt_tokens"] <= 5 * 40
    assert res["pagedllm"]["total_tok_s"] > 0 and res["transformers"]["total_tok_s"] > 0
    assert res["ratio_total_tok_s"] == res["pagedllm"]["total_tok_s"] / res["transformers"]["total_tok_s"]
    assert res["greedy_identical_sequences"] == "5/5"


def test_bench_latency_reports_ttft_and_decode_speed(tiny_model_factory, tmp_path):
    model = str(tiny_model_factory("llama"))
    res = _bench(["latency", "--model", model, "--input-len", "16", "--output-len", "8", "--num-iters", "2",
                  "--num-iters-warmup", "1"], tmp_path)
    for backend in ("pagedllm", "transformers"):
        assert len(res[backend]["ttft_ms"]) == 2 and res[backend]["median_decode_tok_s"] > 0
    assert res["ratio_decode_tok_s"] > 0
