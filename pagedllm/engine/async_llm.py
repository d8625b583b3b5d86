"""AsyncLLM: the engine loop in a background thread, one async stream of outputs per request.

Only the engine thread touches engine state. The event loop validates and
tokenizes a request itself (so errors surface before a response starts), then
hands the prepared request to the engine thread through a command queue;
outputs come back through ``loop.call_soon_threadsafe`` into a per-request
``asyncio.Queue``. Cancelling a stream (a client disconnect) aborts the request
in the core, which frees its KV blocks on the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.processor import PromptType
from pagedllm.errors import EngineDeadError, InvalidParameterError
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


class QueueFullError(InvalidParameterError):
    """More requests are waiting than max_queue_len allows."""


class AsyncLLM:
    def __init__(self, engine: LLMEngine, max_queue_len: int | None = None,
                 on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None):
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.on_step = on_step  # e.g. metrics; runs in the engine thread after each step
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_kwargs(cls, max_queue_len: int | None = None, **kwargs: Any) -> "AsyncLLM":
        return cls(LLMEngine(EngineConfig.from_kwargs(**kwargs)), max_queue_len)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until the request finishes. Raises at once on invalid input."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has died: {self._dead!r}")
        request_id = request_id or uuid.uuid4().hex
        prepared = self.engine.make_request(request_id, prompt, sampling_params, priority)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise InvalidParameterError(f"request id {request_id!r} is already in use", "request_id")
            # in flight but not running = queued (reading the list's length from here is safe)
            waiting = len(self._streams) - len(self.engine.core.scheduler.running)
            if self.max_queue_len is not None and waiting >= self.max_queue_len:
                raise QueueFullError(f"the request queue is full ({waiting} waiting, max_queue_len="
                                     f"{self.max_queue_len}); retry later", "max_queue_len")
            self._streams[request_id] = (loop, q)
        self._commands.put(("add", prepared))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine loop has died: {item!r}") from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float | None = 10.0) -> None:
        self._stopping = True
        self._commands.put(("stop",))
        self._thread.join(timeout)

    # -- the engine thread ------------------------------------------------------
    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            prepared = cmd[1]
            with self._lock:
                alive = prepared.request_id in self._streams
            if alive:  # the client may have gone before we got here
                self.engine.add_prepared_request(prepared)
        elif cmd[0] == "abort":
            self.engine.abort_request([cmd[1]])

    def _run(self) -> None:
        try:
            while not self._stopping:
                busy = self.engine.has_unfinished_requests()
                try:
                    cmd = self._commands.get(block=not busy)  # sleep only when there is nothing to compute
                    while True:
                        if cmd[0] == "stop":
                            return
                        self._apply(cmd)
                        cmd = self._commands.get_nowait()
                except queue.Empty:
                    pass
                if not self.engine.has_unfinished_requests():
                    continue
                outputs = self.engine.step()
                for out in outputs:
                    with self._lock:
                        target = self._streams.get(out.request_id)
                    if target is not None:
                        loop, q = target
                        loop.call_soon_threadsafe(q.put_nowait, out)
                if self.on_step is not None:
                    self.on_step(self.engine, outputs)
        except BaseException as e:  # make every waiting stream fail instead of hanging
            logger.exception("engine loop died")
            self._dead = e
            with self._lock:
                targets = list(self._streams.values())
            for loop, q in targets:
                loop.call_soon_threadsafe(q.put_nowait, e)
