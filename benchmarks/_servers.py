"""Servers for the benchmark scripts: start `pagedllm serve` (or any pagedllm command taking --port) on
a free port and wait until /health answers; stop them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

PAGEDLLM = [sys.executable, "-m", "pagedllm.entrypoints.cli"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], env: dict | None = None, cpus: str | None = None) -> tuple[subprocess.Popen, str]:
    port = _port()
    full = (["taskset", "-c", cpus] if cpus else []) + cmd + ["--port", str(port)]
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(full, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                return proc, url
        except OSError:
            pass
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{cmd} exited: {log.read()[-2000:]}")
        time.sleep(0.5)
    raise RuntimeError(f"{cmd} did not become healthy")


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
