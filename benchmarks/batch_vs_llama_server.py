"""Batched serving on a real-size GGUF, side by side in one command: `pagedllm serve` against llama.cpp's
`llama-server -np N -cb` on the same file, the same requests and the same client.

    python benchmarks/batch_vs_llama_server.py --llama-server PATH
        [--model qwen2.5-coder-1.5b-instruct-q4_k_m | FILE.gguf] [--num-prompts 64] [--input-len 576]
        [--range-ratio 0.778] [--output-len 128] [--modes gguf,gguf-exact] [--threads 2] [--out FILE.json]
        [--level avx2]

The requests: --num-prompts random token-id prompts of --input-len * (1 +- --range-ratio) tokens (128 to 1,024
by default) and --output-len tokens each, EOS ignored, all sent at once; `pagedllm bench serve`, vLLM's
`bench serve` client, measures both servers (streamed completions; TTFT, TPOT, ITL and end-to-end
percentiles; output and total tok/s).

Both servers hold every request at once: llama.cpp ``-np N -cb -c N * (longest prompt + output)`` (its f16 KV
cache, --threads threads), pagedllm ``--max-num-seqs N --max-model-len (longest prompt + output)
--kv-cache-dtype bfloat16`` in each of --modes. Build llama.cpp as the top of benchmarks/real_size.py says;
``--level`` runs pagedllm's kernels at that instruction-set level, beside a llama.cpp built for it (there too).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from _servers import PAGEDLLM, bench_serve, start, stop  # beside this script: on sys.path when it runs
from real_models import resolve, write_report


def _client(url: str, args: argparse.Namespace) -> dict:
    flags = ["--model", "m", "--seed", "0", "--num-prompts", str(args.num_prompts)]
    flags += ["--random-input-len", str(args.input_len), "--random-range-ratio", str(args.range_ratio)]
    flags += ["--random-output-len", str(args.output_len), "--ignore-eos", "--log-level", "WARNING"]
    report = bench_serve(url, flags)
    report.pop("slowest_requests", None)
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct-q4_k_m")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=576)
    p.add_argument("--range-ratio", type=float, default=0.778)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--modes", default="gguf,gguf-exact", help="pagedllm's quantization modes, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    p.add_argument("--level", default=None, help="pagedllm's kernel level ($PAGEDLLM_CPU_LEVEL); default the best")
    args = p.parse_args()
    from pagedllm.benchmarks.optional import require_program
    from pagedllm.kernels import isa

    if args.level:  # a level this machine cannot run fails here, before any server starts
        os.environ[isa.ENV] = args.level
        isa.chosen_level()

    fix = "build it as the top of benchmarks/real_size.py says"
    binary = require_program("benchmarks/batch_vs_llama_server.py --llama-server", args.llama_server, fix)
    model = str(resolve(args.model))
    per_seq = int(args.input_len * (1 + args.range_ratio)) + 1 + args.output_len
    n = args.num_prompts
    servers = {
        "llama.cpp": [binary, "-m", model, "-np", str(n), "-cb", "-c", str(n * per_seq), "-t", str(args.threads)],
    }
    for mode in args.modes.split(","):
        servers[f"pagedllm {mode}"] = [*PAGEDLLM, "serve", model, "--served-model-name", "m"]
        servers[f"pagedllm {mode}"] += ["--quantization", mode, "--max-num-seqs", str(n)]
        servers[f"pagedllm {mode}"] += ["--max-model-len", str(per_seq), "--kv-cache-dtype", "bfloat16"]
    env = {"OMP_NUM_THREADS": str(args.threads)}
    if args.level:
        env[isa.ENV] = args.level
    report: dict = {"model": model, "threads": args.threads, "requests": vars(args) | {"llama_server": binary}}
    report["requests"].pop("out")
    report["results"] = {}
    for name, cmd in servers.items():
        t0 = time.perf_counter()
        proc, url = start(cmd, env=env)
        ready = time.perf_counter() - t0
        try:
            r = _client(url, args)
        finally:
            stop([proc])
        r["ready_s"], r["command"] = ready, " ".join(Path(c).name if os.path.isabs(c) else c for c in cmd)
        report["results"][name] = r
        tok_s = f"{r['total_token_throughput']:.1f} tok/s total, {r['output_throughput']:.1f} out"
        print(f"{name}: {tok_s}", file=sys.stderr, flush=True)
    base = report["results"]["llama.cpp"]["total_token_throughput"]
    print(f"{'server':20s} {'total tok/s':>11s} {'out tok/s':>9s} {'ratio':>6s} {'TTFT p50':>9s} {'TPOT p50':>9s}")
    for name, r in report["results"].items():
        ratio = r["total_token_throughput"] / base
        ttft, tpot = r.get("median_ttft_ms", 0) / 1000, r.get("median_tpot_ms", 0)
        print(
            f"{name:20s} {r['total_token_throughput']:11.1f} {r['output_throughput']:9.1f} {ratio:5.2f}x "
            f"{ttft:8.1f}s {tpot:7.0f}ms"
        )
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
