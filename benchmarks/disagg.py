"""Disaggregated prefill / decode against one colocated engine, in one command: over a shared disk tier
(DiskConnector) and over the network (MooncakeConnector, Mooncake's Transfer Engine over TCP).

    python benchmarks/disagg.py [--model MODEL] [--streams 16] [--stream-output-len 192]
                                [--long-prompts 12] [--long-input-len 1500] [--long-rate 0.25]
                                [--connectors disk,mooncake] [--one-at-a-time 8]

Setups:

* colocated: one `pagedllm serve` with both CPU cores;
* P/D: a prefill server and a decode server, one core each (taskset, one torch thread), behind
  `pagedllm disagg-proxy`; their KV through a disk tier in /dev/shm, or read by the decode server out of the
  prefill server's cache over TCP (Mooncake).

Each setup runs two workloads:

* mixed: two `pagedllm bench serve` runs at once: 16 streams that decode (short prompts, long outputs, 16 in
  flight) and long prompts arriving at a Poisson rate while they do;
* one at a time: ``--one-at-a-time`` long prompts, one request in flight, 16 output tokens: the time to first
  token of a lone request, where the KV's path (computed here, read from disk, pulled over TCP) is what differs.

Reports each setup's bench reports and the ratios against colocated. Prints JSON.
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


def _one_at_a_time(url: str, args: argparse.Namespace, out_dir: str, name: str) -> dict:
    cmd = PAGEDLLM + ["bench", "serve", "--base-url", url, "--random-range-ratio", "0", "--seed", "3"]
    cmd += ["--num-prompts", str(args.one_at_a_time), "--max-concurrency", "1"]
    cmd += ["--random-input-len", str(args.long_input_len), "--random-output-len", "16"]
    cmd += ["--result-file", f"{out_dir}/{name}-one.json"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.load(open(f"{out_dir}/{name}-one.json"))


def _counters(url: str) -> dict:
    """The decode server's KV counters: tokens loaded instead of computed, pulls, failed pulls, preemptions."""
    import urllib.request

    names = (
        "external_prefix_cache_hits_total",
        "kv_transfer_pulls_total",
        "kv_transfer_failures_total",
        "num_preemptions_total",
    )
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        for n in names:
            if line.startswith((f"pagedllm:{n}{{", f"pagedllm:{n} ")):
                out[n] += float(line.rsplit(" ", 1)[1])
    return out


def _connector(kind: str, role: str, kv_dir: str) -> list[str]:
    if kind == "disk":
        config = {"kv_connector": "DiskConnector", "kv_role": role, "kv_connector_extra_config": {"path": kv_dir}}
    else:
        config = {"kv_connector": "MooncakeConnector", "kv_role": role, "kv_connector_extra_config": {}}
    return ["--kv-transfer-config", json.dumps(config)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--stream-output-len", type=int, default=192)
    p.add_argument("--long-prompts", type=int, default=12)
    p.add_argument("--long-input-len", type=int, default=1500)
    p.add_argument("--long-rate", type=float, default=0.25, help="long prompts per second (Poisson)")
    p.add_argument("--connectors", default="disk,mooncake", help="the P/D setups to run: disk, mooncake or both")
    p.add_argument("--one-at-a-time", type=int, default=8, help="long prompts sent one at a time (0: none)")
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
        if args.one_at_a_time:
            report["colocated"]["one"] = _one_at_a_time(url, args, out_dir, "colocated")
    finally:
        _stop([proc])

    one = {"OMP_NUM_THREADS": "1"}
    decode_counters: dict[str, dict] = {}
    for kind in args.connectors.split(","):
        kv_dir = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        procs = []
        try:
            pre, pre_url = _start(serve + _connector(kind, "kv_producer", kv_dir), one, "0")
            procs.append(pre)
            dec, dec_url = _start(serve + _connector(kind, "kv_consumer", kv_dir), one, "1")
            procs.append(dec)
            proxy, proxy_url = _start(PAGEDLLM + ["disagg-proxy", "--prefill", pre_url, "--decode", dec_url], None, "1")
            procs.append(proxy)
            name = f"pd_{kind}"
            report[name] = _workload(proxy_url, args, out_dir, name)
            if args.one_at_a_time:
                report[name]["one"] = _one_at_a_time(proxy_url, args, out_dir, name)
            decode_counters[name] = _counters(dec_url)
        finally:
            _stop(procs)
            shutil.rmtree(kv_dir, ignore_errors=True)

    summary: dict = {setup: {part: {k: r[part].get(k) for k in KEYS} for part in r} for setup, r in report.items()}
    c = summary["colocated"]
    for setup in [s for s in summary if s != "colocated"]:
        d = summary[setup]
        ratios = {
            "streams_p99_itl": d["streams"]["p99_itl_ms"] / c["streams"]["p99_itl_ms"],
            "streams_median_itl": d["streams"]["median_itl_ms"] / c["streams"]["median_itl_ms"],
            "streams_median_ttft": d["streams"]["median_ttft_ms"] / c["streams"]["median_ttft_ms"],
            "long_median_ttft": d["long"]["median_ttft_ms"] / c["long"]["median_ttft_ms"],
        }
        if "one" in d:
            ratios["one_at_a_time_median_ttft"] = d["one"]["median_ttft_ms"] / c["one"]["median_ttft_ms"]
        summary[f"{setup}_over_colocated"] = {k: round(v, 3) for k, v in ratios.items()}
    summary["decode_server"] = decode_counters  # what reached it from the prefill server, and what failed
    summary["workload"] = vars(args)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
