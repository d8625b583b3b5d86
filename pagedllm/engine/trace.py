"""``--trace-file``: the engine's steps and requests as a Chrome / Perfetto trace (JSON array format).

Open the file in ``chrome://tracing`` or https://ui.perfetto.dev. Track "engine" holds
one slice per step (its decode and prefill tokens, running and waiting counts); each
request is an async slice from arrival to finish with instants for "scheduled" and
"first token", and its token counts and finish reason. Events are built on the engine
thread from what the step already produced, and a writer thread does the file I/O,
so the engine never waits on the disk. The array is closed at shutdown; a file cut
short by a crash still opens (both viewers accept a missing ``]``).
"""

from __future__ import annotations

import json
import os
import queue
import threading
from typing import Any

_PID = 1
_ENGINE_TID = 1


class ChromeTraceWriter:
    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "w", encoding="utf-8")  # noqa: SIM115 -- closed by close()
        self._f.write('[{"ph": "M", "pid": 1, "tid": 1, "name": "thread_name", "args": {"name": "engine"}}')
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._seen: dict[str, bool] = {}  # requests whose begin event is out -> their first token is too
        self._last_step = 0.0
        self._thread = threading.Thread(target=self._write, name="pagedllm-trace", daemon=True)
        self._thread.start()

    def on_step(self, engine: Any, outputs: list) -> None:
        """Called on the engine thread after each step."""
        events = []
        core = engine.core
        if core.step_history and core.step_history[-1][0] > self._last_step:
            t, dt, decode, prefill = core.step_history[-1]
            self._last_step = t
            events.append({"ph": "X", "pid": _PID, "tid": _ENGINE_TID, "name": "step", "ts": _us(t), "dur": _us(dt),
                           "args": {"decode_tokens": decode, "prefill_tokens": prefill,
                                    "running": len(core.scheduler.running),
                                    "waiting": core.scheduler.num_waiting_requests()}})
        for out in outputs:
            rid, m = out.request_id, out.metrics
            common = {"pid": _PID, "cat": "request", "id": rid, "name": "request"}
            if rid not in self._seen:
                self._seen[rid] = False
                events.append({**common, "ph": "b", "ts": _us(m.arrival_time),
                               "args": {"request_id": rid, "prompt_tokens": len(out.prompt_token_ids)}})
                if m.first_scheduled_time is not None:
                    events.append({**common, "ph": "n", "name": "scheduled", "ts": _us(m.first_scheduled_time)})
            if not self._seen[rid] and m.first_token_time is not None:
                self._seen[rid] = True
                events.append({**common, "ph": "n", "name": "first token", "ts": _us(m.first_token_time)})
            if out.finished:
                del self._seen[rid]
                end = m.finished_time or m.last_token_time or m.arrival_time
                events.append({**common, "ph": "e", "ts": _us(end), "args": {
                    "finish_reason": [c.finish_reason for c in out.outputs],
                    "output_tokens": sum(len(c.token_ids) for c in out.outputs),
                    "cached_prompt_tokens": out.num_cached_tokens}})
        if events:
            self._q.put(events)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)

    def _write(self) -> None:
        while True:
            events = self._q.get()
            if events is None:
                break
            self._f.write("".join(",\n" + json.dumps(e) for e in events))
            self._f.flush()
        self._f.write("]\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 1)
