"""The ``mp`` executor: one worker process per rank on this node.

Workers are started as ``python -m pagedllm.executor.worker_process`` (not
forked: a forked process would inherit the engine's threads and locks, and
multiprocessing's spawn would re-run the user's script), each talking to the
engine over its own socket pair. They join one torch.distributed group at a
port the OS picked at start-up.
"""

from __future__ import annotations

import logging
import pickle
import socket
import subprocess
import sys
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, cast

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.distributed import get_open_port
from pagedllm.executor.base import DistributedExecutor, worker_threads
from pagedllm.worker.runner_output import ModelRunnerOutput

logger = logging.getLogger("pagedllm")


class MultiprocExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig):
        super().__init__(config)
        pc = config.parallel_config
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        threads = worker_threads(self.world_size)
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        for rank in range(self.world_size):
            ours, theirs = socket.socketpair()
            with theirs:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "pagedllm.executor.worker_process", str(theirs.fileno())],
                        pass_fds=(theirs.fileno(),),
                    )
                )
            conn = Connection(ours.detach())
            conn.send((config, rank, init_method, threads))
            self.conns.append(conn)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        logger.info(
            "started %d worker processes (tp=%d, pp=%d, %d torch threads each)",
            self.world_size,
            pc.tensor_parallel_size,
            pc.pipeline_parallel_size,
            threads,
        )
        self._receive(range(self.world_size))  # every Worker built: the process group is up

    # -- calls ------------------------------------------------------------------
    def _send(self, ranks: range | list[int], payload: bytes) -> None:
        for rank in ranks:
            try:
                self.conns[rank].send_bytes(payload)
            except OSError:
                self._fail(f"worker {rank} is gone (its connection closed)")

    def _receive(self, ranks: Any) -> list[Any]:
        """The replies of ``ranks``, in order; any error or death on any rank stops every worker and raises."""
        want = set(ranks)
        got: dict[int, Any] = {}
        index = {conn: rank for rank, conn in enumerate(self.conns)}
        while want - got.keys():
            for conn in cast("list[Connection]", wait(self.conns, timeout=1.0)):  # ready ones of those given
                rank = index[conn]
                try:
                    reply = conn.recv()
                except (EOFError, OSError):
                    self._fail(f"worker {rank} died (exit code {self.procs[rank].poll()})")
                if reply[0] == "error":
                    failed = f"worker {rank} failed: {reply[1]!r}\n{reply[2]}"
                    cause = self._peer_failure(rank)
                    # its collective may have broken because a peer died or failed first: that is the cause
                    self._fail(failed if cause is None else f"{cause}; then {failed}", reply[1])
                got[rank] = reply[1]
            for rank, proc in enumerate(self.procs):
                if proc.poll() is not None and rank in want - got.keys():
                    self._fail(f"worker {rank} died (exit code {proc.returncode})")
        return [got[r] for r in sorted(want)]

    def _peer_failure(self, rank: int, grace: float = 1.0) -> str | None:
        """How a rank other than ``rank`` failed, waiting up to ``grace`` seconds: an error it reported (a worker
        exits after sending one), or its death by a signal or a crash (a killed peer closes its sockets, which
        fails the others' collectives, a moment before it can be reaped); None if every other rank is well."""
        deadline = time.monotonic() + grace
        while True:
            for other, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True)):
                if other == rank:
                    continue
                try:
                    reply = conn.recv() if conn.poll() else None
                except (EOFError, OSError):
                    reply = None  # its end closed: its exit code tells
                if reply is not None and reply[0] == "error":
                    return f"worker {other} failed: {reply[1]!r}\n{reply[2]}"
                if proc.poll() not in (None, 0):
                    return f"worker {other} died (exit code {proc.returncode})"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _call_all(self, method: str, args: tuple) -> list[Any]:
        self._send(range(self.world_size), pickle.dumps((method, args)))
        return self._receive(range(self.world_size))

    def _send_step(self, so: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        others = [r for r in range(self.world_size) if r != self.driver]
        self._send([self.driver], pickle.dumps(("execute_model", (so, None))))
        self._send(others, pickle.dumps(("execute_model", (so, sampled))))

    def _receive_step(self) -> ModelRunnerOutput:
        return self._receive([self.driver])[0]

    def _stop_workers(self) -> None:
        self.shutdown(graceful=False)

    def failure(self) -> str | None:
        if self._dead is None:
            for rank, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    return f"worker {rank} died (exit code {proc.returncode})"
        return self._dead

    def shutdown(self, graceful: bool = True) -> None:
        _stop(self.procs, self.conns, timeout=5.0 if graceful and self._dead is None else 0.0)
        self._dead = self._dead or "the engine was shut down"
        self._finalizer.detach()


def _stop(procs: list[subprocess.Popen], conns: list[Connection], timeout: float = 5.0) -> None:
    """Ask every worker to stop, give them ``timeout`` seconds, then kill what is left."""
    payload = pickle.dumps(("shutdown", ()))
    for conn in conns:
        try:
            conn.send_bytes(payload)
        except OSError:
            pass
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for conn in conns:
        conn.close()
