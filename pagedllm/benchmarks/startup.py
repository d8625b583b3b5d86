"""`pagedllm bench startup`: process start to first token, cold and warm, beside transformers.

Each run is a fresh Python process, timed from its launch to its first generated
token (one greedy token of a short prompt), so imports, compilation, conversion and
weight loading all count:

* pagedllm cold: an empty ``PAGEDLLM_CACHE_DIR`` (kernels compiled, tokenizer and config converted);
* pagedllm warm: the same cache directory again;
* transformers: ``AutoTokenizer`` + ``AutoModelForCausalLM`` (float32) from the same checkpoint,
  ``generate(max_new_tokens=1)``; it keeps no cache of its own, so one figure serves for both.

The operating system's file cache is warm for every run after the first (the
checkpoint is read once up front), so the figures compare the engines, not the disk.

    pagedllm bench startup                 # the default model
    pagedllm bench startup --runs 3        # medians of 3 runs each
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_PAGEDLLM = """
import json, sys, time
from pagedllm import LLM, SamplingParams
llm = LLM(model={model!r})
llm.generate("Hello", SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
done = time.time()
engine = llm.llm_engine
print(json.dumps({{"first_token_at": done, "engine_ready_s": engine.startup_seconds,
                  "stages_s": engine.startup_stages}}))
"""

_TRANSFORMERS = """
import json, os, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, kind = {path!r}, {kind!r}
kw = dict(gguf_file=os.path.basename(path)) if kind == "gguf" else {{}}
where = os.path.dirname(path) if kind == "gguf" else path
t = time.time()
tok = AutoTokenizer.from_pretrained(where, **kw)
model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw).eval()
loaded = time.time()
with torch.inference_mode():
    model.generate(tok("Hello", return_tensors="pt").input_ids, max_new_tokens=1, do_sample=False)
print(json.dumps({{"first_token_at": time.time(), "load_s": loaded - t}}))
"""


def _run(name: str, script: str, env: dict[str, str]) -> dict:
    """Launch a fresh interpreter; its report plus the seconds from launch to its first token."""
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the {name} start-up run failed (exit code {proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["first_token_s"] = report.pop("first_token_at") - start
    return report


def run_startup(model: str | None, runs: int, backend: str) -> dict:
    from tqdm.auto import tqdm

    from pagedllm.model_loader import resolve_model

    src = resolve_model(model)
    with open(src.path if src.kind == "gguf" else os.devnull, "rb") as f:  # warm the OS file cache once
        while f.read(1 << 24):
            pass
    env = {**os.environ, "PAGEDLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    results: dict = {"model": src.name, "runs": runs}
    jobs = []
    if backend in ("pagedllm", "both"):
        script = _PAGEDLLM.format(model=model)
        jobs += [("pagedllm_cold", script), ("pagedllm_warm", script)]  # the same cache: the second is warm
    if backend in ("transformers", "both"):
        jobs.append(("transformers", _TRANSFORMERS.format(path=src.path, kind=src.kind)))
    samples: dict[str, list[dict]] = {name: [] for name, _ in jobs}
    with tqdm(total=len(jobs) * runs, desc="start-up runs", unit="run") as bar:
        for _ in range(runs):
            with tempfile.TemporaryDirectory(prefix="pagedllm-bench-cache-") as cache:
                for name, script in jobs:
                    bar.set_postfix_str(name)
                    run_env = {**env, "PAGEDLLM_CACHE_DIR": cache}
                    samples[name].append(_run(name, script, run_env))
                    # each run's figures as soon as it is done: a later run that fails cannot take them with it
                    bar.write(f"{name}: {json.dumps(samples[name][-1])}", file=sys.stderr)
                    bar.update(1)
    for name, reports in samples.items():
        times = [r["first_token_s"] for r in reports]
        results[name] = {
            "first_token_s": statistics.median(times),
            "first_token_s_runs": times,
            **{k: v for k, v in reports[len(reports) // 2].items() if k != "first_token_s"},
        }
    if "pagedllm_cold" in results and "transformers" in results:
        hf = results["transformers"]["first_token_s"]
        results["cold_vs_transformers"] = results["pagedllm_cold"]["first_token_s"] / hf
        results["warm_vs_transformers"] = results["pagedllm_warm"]["first_token_s"] / hf
    return results


def add_parser(sub) -> None:
    from pagedllm.entrypoints.cli_args import add_command

    p = add_command(sub, "startup", help="process start to first token, cold and warm, beside transformers")
    p.add_argument("--model", default=None, help="model path or cached repo id; default: the embedded SmolLM2")
    p.add_argument(
        "--backend",
        choices=["pagedllm", "transformers", "both"],
        default="both",
        help="both: pagedllm cold and warm, and transformers, with the ratios",
    )
    p.add_argument("--runs", type=int, default=1, help="runs of each; the report gives medians")
    p.add_argument("--output-json", default=None, help="also write the JSON report here")
    p.set_defaults(func=_cmd_startup)


def _cmd_startup(args) -> int:
    from pagedllm.benchmarks.offline import emit

    if args.runs < 1:
        from pagedllm.errors import InvalidParameterError

        raise InvalidParameterError(f"--runs must be >= 1, got {args.runs}", "runs")
    if args.backend in ("transformers", "both"):
        from pagedllm.benchmarks.optional import require_transformers_for

        require_transformers_for(args.model, "pagedllm bench startup times transformers' start too")
    emit(run_startup(args.model, args.runs, args.backend), args.output_json)
    return 0
