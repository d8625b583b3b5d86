"""Decode speed beside busy neighbour processes: threads that follow the free cores against a fixed count.

    python benchmarks/cpu_share.py [--model MODEL] [--quantization Q] [--hogs 0,1,2] [--reps 3]

For each count of neighbours (processes that spin on a core, started first), each mode runs in a fresh
process `--reps` times, the modes alternating: the default (`cpu_threads` unset: the worker gives up the
threads whose cores a neighbour holds, pagedllm/worker/cpu_share.py) and `--cpu-threads` fixed to every core
of this machine (what a count read once at start-up does). Each run warms up for 3 s, so the default has
looked at the machine twice, then times one stream and a batch of 16, 64 tokens each (greedy, no EOS).
Prints JSON: the median tok/s of each (neighbours, mode), and the default's ratio to the fixed count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

RUN = """
import json, sys, time
from pagedllm import LLM, SamplingParams
kw = json.loads(sys.argv[1])
llm = LLM(**kw)
sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
t = time.perf_counter()
while time.perf_counter() - t < 3:
    llm.generate(["warm up"], sp, use_tqdm=False)
t = time.perf_counter(); llm.generate(["Tell me a story about a cat."], sp, use_tqdm=False)
one = 64 / (time.perf_counter() - t)
t = time.perf_counter(); llm.generate([f"Story {i}: once upon a time" for i in range(16)], sp, use_tqdm=False)
batch = 16 * 64 / (time.perf_counter() - t)
print(json.dumps({"one": one, "batch16": batch, "threads": llm.llm_engine.executor.worker._threads}))
"""


def _run(kw: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", RUN, json.dumps(kw)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--hogs", default="0,1,2", help="neighbour counts to run beside, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    base = {k: v for k, v in (("model", args.model), ("quantization", args.quantization)) if v is not None}
    modes = {"follows free cores": base, f"fixed {cores}": {**base, "cpu_threads": cores}}
    report: dict = {"cores": cores, "model": args.model or "SmolLM2-135M (embedded)", "runs": {}}
    for hogs in [int(h) for h in args.hogs.split(",")]:
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
        try:
            runs: dict[str, list[dict]] = {m: [] for m in modes}
            for _ in range(args.reps):
                for name, kw in modes.items():
                    runs[name].append(_run(kw))
        finally:
            for p in procs:
                p.kill()
                p.wait()
        row = {
            name: {
                "one_tok_s": round(statistics.median(r["one"] for r in rs), 1),
                "batch16_tok_s": round(statistics.median(r["batch16"] for r in rs), 1),
                "threads_at_end": [r["threads"] for r in rs],
            }
            for name, rs in runs.items()
        }
        a, b = (row[m] for m in modes)
        row["ratio"] = {k: round(a[k] / b[k], 2) for k in ("one_tok_s", "batch16_tok_s")}
        report["runs"][f"{hogs} neighbours"] = row
        print(json.dumps({f"{hogs} neighbours": row}), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
