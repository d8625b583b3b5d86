"""Servers for the benchmark scripts: start `pagedllm serve` (or any pagedllm command taking --port) on
a free port and wait until /health answers; stop them; measure one with `pagedllm bench serve`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PAGEDLLM = [sys.executable, "-m", "pagedllm.entrypoints.cli"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    cmd: list[str], env: dict | None = None, cpus: str | None = None, wait_s: float = 300
) -> tuple[subprocess.Popen, str]:
    port = _port()
    full = (["taskset", "-c", cpus] if cpus else []) + cmd + ["--port", str(port)]
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(full, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    for _ in range(int(wait_s * 2)):
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                return proc, url
        except OSError:
            pass
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{cmd} exited: {log.read()[-2000:]}")
        time.sleep(0.5)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"{cmd} did not become healthy")


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def bench_serve(url: str, flags: list[str]) -> dict:
    """`pagedllm bench serve --base-url URL FLAGS...` run to its end; its JSON report."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [*PAGEDLLM, "bench", "serve", "--base-url", url, *flags, "--result-file", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())
