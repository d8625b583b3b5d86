"""Serving against offline on the same requests, in one command: what the HTTP server costs.

    python benchmarks/serve_vs_offline.py [--model MODEL] [--num-prompts 48] [--max-concurrency 16]
                                          [--quantization int4] [--skip-offline]

The workload is vLLM's `bench serve` random dataset as issue 18 states it: 256 ± 50 % prompt tokens,
128 ± 50 % output tokens (EOS ignored, greedy), 48 requests.

* offline: `LLM(max_num_seqs=C).generate` on all of them at once (C = --max-concurrency), timing every
  engine step;
* serving: `pagedllm serve --max-num-seqs C` in its own process and `pagedllm bench serve
  --max-concurrency C` (streaming, token-id prompts) from this one.

Both sides are warmed up alike before they are timed, with the same two requests of other prompts
(`bench serve --num-warmups 2` sends them): until 2026-11-25 offline warmed up on two of the timed
prompts, so their prefills were prefix-cache hits in its timed run, and the server was not warmed at all.

Reports both total token throughputs and their ratio, and the serving median ITL against offline's
median decode step time. Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time

from _servers import PAGEDLLM, start, stop


def offline(data: list[tuple[list[int], int]], warm: list[tuple[list[int], int]], args: argparse.Namespace) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=args.model, max_num_seqs=args.max_concurrency, quantization=args.quantization)
    engine = llm.llm_engine
    steps: list[float] = []
    step = engine.step

    def timed_step():
        t = time.perf_counter()
        out = step()
        steps.append(time.perf_counter() - t)
        return out

    prompts = [{"prompt_token_ids": p} for p, _ in data]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in data]
    warm_params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in warm]
    llm.generate([{"prompt_token_ids": p} for p, _ in warm], warm_params, use_tqdm=False)
    engine.step = timed_step
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    engine.step = step
    n_in, n_out = sum(len(p) for p, _ in data), sum(len(o.outputs[0].token_ids) for o in outs)
    del llm, engine
    gc.collect()
    return {
        "duration_s": elapsed,
        "total_token_throughput": (n_in + n_out) / elapsed,
        "output_throughput": n_out / elapsed,
        "steps": len(steps),
        "median_step_ms": statistics.median(steps) * 1000,
    }


def serving(args: argparse.Namespace) -> dict:
    from pagedllm.benchmarks import serve as bench_serve

    cmd = PAGEDLLM + ["serve", "--max-num-seqs", str(args.max_concurrency)]
    cmd += ([args.model] if args.model else []) + (["--quantization", args.quantization] if args.quantization else [])
    proc, url = start(cmd)
    try:
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers()
        bench_serve.add_parser(sub)
        bargs = parser.parse_args(
            [
                "serve",
                "--base-url",
                url,
                "--num-prompts",
                str(args.num_prompts),
                "--random-input-len",
                "256",
                "--random-output-len",
                "128",
                "--random-range-ratio",
                "0.5",
                "--random-output-range-ratio",
                "0.5",
                "--max-concurrency",
                str(args.max_concurrency),
                "--seed",
                str(args.seed),
                "--num-warmups",
                "2",
            ]
        )
        return asyncio.run(bench_serve.run(bargs))
    finally:
        stop([proc])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--quantization", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-offline", action="store_true", help="only the serving run")
    args = p.parse_args()
    from pagedllm.benchmarks.optional import require
    from pagedllm.benchmarks.serve import random_dataset

    require("benchmarks/serve_vs_offline.py", "httpx", "pip install httpx", "to send the serving run's requests")

    data = random_dataset(args.num_prompts, 256, 128, 0.5, 0.5, 49152, args.seed)
    warm = random_dataset(2, 256, 128, 0.5, 0.5, 49152, args.seed + 1)  # what `bench serve --num-warmups 2` sends
    off = None if args.skip_offline else offline(data, warm, args)
    srv = serving(args)
    keys = (
        "duration_s",
        "total_token_throughput",
        "output_throughput",
        "median_ttft_ms",
        "median_tpot_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "completed",
        "failed",
    )
    report = {"offline": off, "serving": {k: srv.get(k) for k in keys}}
    if off:
        report["serving_vs_offline_throughput"] = srv["total_token_throughput"] / off["total_token_throughput"]
        report["serving_median_itl_vs_offline_step"] = srv["median_itl_ms"] / off["median_step_ms"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
