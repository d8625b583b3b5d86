"""Disaggregated prefill / decode against one colocated engine, under a mixed workload, in one command.

    python benchmarks/disagg.py [--model MODEL] [--streams 16] [--stream-output-len 192]
                                [--long-prompts 12] [--long-input-len 1500] [--long-rate 0.25]

Two `pagedllm bench serve` runs go at once against each setup: 16 streams that decode (short prompts,
long outputs, 16 in flight) and long prompts arriving at a Poisson rate while they do. Setups:

* colocated: one `pagedllm serve` with both CPU cores;
* P/D: a prefill server and a decode server, one core each (taskset, one torch thread), sharing a
  disk KV tier in /dev/shm, behind `pagedllm disagg-proxy`.

Reports each setup's two bench reports and the decode streams' p99 ITL and TTFT ratios. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time

from _servers import PAGEDLLM
from _servers import start as _start
from _servers import stop as _stop


def _workload(url: str, args: argparse.Namespace, out_dir: str, name: str) -> dict:
    """The decode streams and the long prompts, at once; their two reports."""
    common = PAGEDLLM + ["bench", "serve", "--base-url", url, "--random-range-ratio", "0", "--seed", "1"]
    streams = common + [
        "--num-prompts",
        str(2 * args.streams),
        "--max-concurrency",
        str(args.streams),
        "--random-input-len",
        "64",
        "--random-output-len",
        str(args.stream_output_len),
        "--result-file",
        f"{out_dir}/{name}-streams.json",
    ]
    longs = common + [
        "--num-prompts",
        str(args.long_prompts),
        "--request-rate",
        str(args.long_rate),
        "--random-input-len",
        str(args.long_input_len),
        "--random-output-len",
        "16",
        "--seed",
        "2",
        "--result-file",
        f"{out_dir}/{name}-long.json",
    ]
    a = subprocess.Popen(streams, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(5)  # the streams are decoding when the first long prompt comes
    b = subprocess.Popen(longs, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    a.wait(), b.wait()
    return {part: json.load(open(f"{out_dir}/{name}-{part}.json")) for part in ("streams", "long")}


KEYS = (
    "completed",
    "failed",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_tpot_ms",
    "output_throughput",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--stream-output-len", type=int, default=192)
    p.add_argument("--long-prompts", type=int, default=12)
    p.add_argument("--long-input-len", type=int, default=1500)
    p.add_argument("--long-rate", type=float, default=0.25, help="long prompts per second (Poisson)")
    args = p.parse_args()
    model = [args.model] if args.model else []
    serve = PAGEDLLM + [
        "serve",
        *model,
        "--max-model-len",
        "2048",
        "--kv-cache-memory",
        str(1 << 30),
        "--uvicorn-log-level",
        "warning",
        "--log-level",
        "WARNING",
    ]
    out_dir = tempfile.mkdtemp()
    report: dict = {}

    proc, url = _start(serve)
    try:
        report["colocated"] = _workload(url, args, out_dir, "colocated")
    finally:
        _stop([proc])

    kv_dir = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    one = {"OMP_NUM_THREADS": "1"}

    def tier(role: str) -> list[str]:
        return [
            "--kv-transfer-config",
            json.dumps(
                {"kv_connector": "DiskConnector", "kv_role": role, "kv_connector_extra_config": {"path": kv_dir}}
            ),
        ]

    procs = []
    try:
        pre, pre_url = _start(serve + tier("kv_producer"), one, "0")
        procs.append(pre)
        dec, dec_url = _start(serve + tier("kv_consumer"), one, "1")
        procs.append(dec)
        proxy, proxy_url = _start(PAGEDLLM + ["disagg-proxy", "--prefill", pre_url, "--decode", dec_url], None, "1")
        procs.append(proxy)
        report["pd"] = _workload(proxy_url, args, out_dir, "pd")
    finally:
        _stop(procs)
        shutil.rmtree(kv_dir, ignore_errors=True)

    summary = {setup: {part: {k: r[part].get(k) for k in KEYS} for part in r} for setup, r in report.items()}
    c, d = summary["colocated"], summary["pd"]
    summary["streams_p99_itl_ratio_pd_over_colocated"] = round(
        d["streams"]["p99_itl_ms"] / c["streams"]["p99_itl_ms"], 3
    )
    summary["long_median_ttft_ratio_pd_over_colocated"] = round(
        d["long"]["median_ttft_ms"] / c["long"]["median_ttft_ms"], 3
    )
    summary["streams_median_ttft_ratio_pd_over_colocated"] = round(
        d["streams"]["median_ttft_ms"] / c["streams"]["median_ttft_ms"], 3
    )
    summary["workload"] = vars(args)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
