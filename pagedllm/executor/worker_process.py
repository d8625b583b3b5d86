"""A worker process of the ``mp`` executor: ``python -m pagedllm.executor.worker_process FD``.

FD is this process's end of a socket pair with the engine. The engine sends the
Worker's arguments, then ``(method, args)`` calls; every call is answered, except
the steps of ranks that do not sample, which answer only with an error. The
process ends on ``shutdown``, when the engine's end closes, or after an error.
"""

from __future__ import annotations

import pickle
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any


def serve(conn: Connection, make_worker: Callable[[], Any]) -> None:
    """Build the worker, then answer calls until told to stop; shared with nothing else on purpose: the
    engine reads a reply of ``("ok", result)`` or ``("error", exception, traceback text)``."""
    from pagedllm.distributed import destroy_distributed

    try:
        worker = make_worker()
        conn.send(("ok", None))
        while True:
            try:
                method, args = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # the engine is gone
                break
            if method == "shutdown":
                break
            result = getattr(worker, method)(*args)
            if method != "execute_model" or result is not None:
                conn.send(("ok", result))
    except BaseException as e:
        _send_error(conn, e)
    finally:
        destroy_distributed()


def _send_error(conn: Connection, e: BaseException) -> None:
    text = "".join(traceback.format_exception(e))
    try:
        pickle.dumps(e)
    except Exception:
        e = RuntimeError(f"{type(e).__name__}: {e}")
    try:
        conn.send(("error", e, text))
    except OSError:
        pass


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    config, rank, init_method, num_threads = conn.recv()
    from pagedllm.worker.worker import Worker

    serve(conn, lambda: Worker(config, rank, init_method, num_threads))


if __name__ == "__main__":
    main()
