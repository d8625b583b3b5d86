"""The live engine dashboard: ``GET /dashboard`` (one self-contained page) fed by
``GET /v1/engine/state/stream`` (Server-Sent Events of the ``/v1/engine/state`` snapshot).

The hub takes snapshots only while someone watches, and one per interval however many
watch: every watcher gets the same serialized snapshot. A watcher that reads slowly
skips to the newest one rather than queueing old ones.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources


def dashboard_html() -> str:
    """The page, from the package (no CDN, no network fetch: its CSS and script are inline)."""
    return resources.files("pagedllm.entrypoints.openai").joinpath("static/dashboard.html").read_text("utf-8")


class EngineStateHub:
    def __init__(self, take: Callable[[], Awaitable[dict]], interval: float = 1.0, max_watchers: int = 16):
        if interval <= 0:
            raise ValueError("the engine state interval must be > 0 seconds")
        self._take = take
        self.interval = interval
        self.max_watchers = max_watchers
        self._watchers: set[asyncio.Queue[str | None]] = set()  # None ends a watcher's stream
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    @property
    def full(self) -> bool:
        return len(self._watchers) >= self.max_watchers

    def close_soon(self) -> None:
        """End every stream (the server is draining: these would never finish by themselves). Any thread."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._close)
        self.closed = True

    def _close(self) -> None:
        self.closed = True
        for q in self._watchers:
            if q.full():
                q.get_nowait()
            q.put_nowait(None)

    async def stream(self) -> AsyncIterator[str]:
        """SSE events, one per snapshot, until the client goes away (the endpoint checks ``full`` first)."""
        if self.closed:
            return
        self._loop = asyncio.get_running_loop()
        q: asyncio.Queue[str | None] = asyncio.Queue(maxsize=1)
        self._watchers.add(q)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        try:
            yield f"retry: {int(self.interval * 2000)}\n\n"
            while (data := await q.get()) is not None:
                yield f"data: {data}\n\n"
        finally:
            self._watchers.discard(q)

    async def _run(self) -> None:
        while self._watchers and not self.closed:
            try:
                data = json.dumps(await self._take(), separators=(",", ":"))
            except Exception as e:
                data = json.dumps({"error": f"{type(e).__name__}: {e}"})
            if self.closed:
                return
            for q in list(self._watchers):
                if q.full():  # a slow reader gets the newest snapshot, not a backlog
                    q.get_nowait()
                q.put_nowait(data)
            await asyncio.sleep(self.interval)
