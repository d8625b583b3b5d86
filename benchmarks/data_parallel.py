"""W64-like serving throughput of `pagedllm serve --data-parallel-size N` against one engine, side by side.

    python benchmarks/data_parallel.py [--dp 2] [--num-prompts 64] [--input-len 256] [--output-len 128]

Starts `pagedllm serve` (the embedded SmolLM2 unless --model) once with one engine and once with N
replicas behind the router, runs `pagedllm bench serve` (all prompts at once, EOS ignored) against each
on a free loopback port, and prints both reports' throughput and their ratio as JSON.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

from _servers import bench_serve  # beside this script: the folder is on sys.path when it runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(extra: list[str], model: str | None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "pagedllm.entrypoints.cli",
        "serve",
        *([model] if model else []),
        "--port",
        str(port),
        "--uvicorn-log-level",
        "warning",
        "--max-queue-len",
        "4096",
        *extra,
    ]
    import httpx  # checked by main()

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                backends = httpx.get(f"{url}/backends", timeout=1)
                if backends.status_code != 200 or all(b["healthy"] for b in backends.json()):
                    return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {cmd}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not become healthy")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    from pagedllm.benchmarks.optional import require

    require("benchmarks/data_parallel.py", "httpx", "pip install httpx", "to poll its servers and send requests")
    results = {}
    for name, extra in (("single", []), (f"dp{args.dp}", ["--data-parallel-size", str(args.dp)])):
        proc, url = _serve(extra, args.model)
        try:
            flags = ["--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len)]
            report = bench_serve(url, [*flags, "--random-output-len", str(args.output_len), "--ignore-eos"])
        finally:
            proc.terminate()
            proc.wait(60)
        results[name] = {
            k: report[k] for k in ("duration_s", "output_throughput", "total_token_throughput") if k in report
        }
    results["ratio_total_tok_s"] = (
        results[f"dp{args.dp}"]["total_token_throughput"] / results["single"]["total_token_throughput"]
    )
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
