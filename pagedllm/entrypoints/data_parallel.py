"""``pagedllm serve --data-parallel-size N``: N engine replicas, each a ``pagedllm serve`` process of its
own on a loopback port chosen by the OS, behind one API server (the router, balancing by each replica's
queue length and KV cache usage). Each replica gets this node's cores / N torch threads. The replicas
stop with the front server (SIGTERM, then SIGKILL after the drain timeout), and die with it on Linux
even when it is killed."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from typing import Any

logger = logging.getLogger("pagedllm")

_FRONT_ONLY = {"--data-parallel-size", "--port", "--host", "--data-parallel-routing"}


def replica_argv(argv: list[str]) -> list[str]:
    """The ``serve`` command line of one replica: the front's, without the flags only the front takes."""
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
            continue
        name = tok.split("=", 1)[0]
        if name in _FRONT_ONLY:
            skip = "=" not in tok
            continue
        out.append(tok)
    return out


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def serve_data_parallel(args: Any, argv: list[str]) -> int:
    from pagedllm.distributed import get_open_port
    from pagedllm.entrypoints.graceful_server import connection_bounds
    from pagedllm.entrypoints.router import RouterConfig, run_router
    from pagedllm.executor import worker_threads

    n = args.data_parallel_size  # checked by EngineConfig
    ports = [get_open_port() for _ in range(n)]
    env = dict(os.environ, OMP_NUM_THREADS=str(worker_threads(n)))
    base = replica_argv(argv)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pagedllm.entrypoints.cli", *base, "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        for port in ports
    ]
    logger.info("data parallel: %d engine replicas on ports %s, %s threads each", n, ports, env["OMP_NUM_THREADS"])
    config = RouterConfig(
        [f"http://127.0.0.1:{p}" for p in ports], routing=args.data_parallel_routing, health_check_interval=0.5
    )
    try:
        run_router(
            config,
            args.host,
            args.port,
            api_key=args.api_key or os.environ.get("PAGEDLLM_API_KEY"),
            log_level=args.uvicorn_log_level,
            max_body_bytes=args.max_request_body_bytes,
            timeout_keep_alive=args.timeout_keep_alive,
            connections=connection_bounds(args),
        )
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(args.shutdown_timeout + 5)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0
