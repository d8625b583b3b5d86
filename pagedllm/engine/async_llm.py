"""AsyncLLM: the engine loop in a background thread, one async stream of outputs per request.

Only the engine thread touches engine state. Tokenization, chat templating and
the fan-out of a request into its child requests (prompts x n) run on a worker
thread (`prepare`), never on the event loop, so a large request cannot stall
health probes or other clients. The prepared request is then admitted (every
child counts against ``max_queue_len``) and handed to the engine thread through
a command queue; outputs come back, once a step, through a courier thread and
``loop.call_soon_threadsafe`` into a per-request ``asyncio.Queue``. Closing a stream
(a client disconnect) aborts the request in the core, which frees its KV blocks on
the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar, cast

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine, PreparedRequest
from pagedllm.engine.processor import PromptType
from pagedllm.errors import EngineDeadError, InvalidParameterError, QueueFullError, RequestFailedError
from pagedllm.malloc_arena import share_main_arena
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.pooling import EmbeddingRequestOutput
    from pagedllm.pooling_params import PoolingParams

logger = logging.getLogger("pagedllm")

T = TypeVar("T")

MAX_RESTARTS = 3  # rebuilds of the engine core within RESTART_WINDOW_S before the engine gives up (and the server
RESTART_WINDOW_S = 600.0  # exits non-zero, for an orchestrator to restart it)


__all__ = ["AsyncLLM", "QueueFullError", "RequestStream"]


class RequestStream:
    """The outputs of one request, as an async iterator; ``aclose()`` aborts it if it is unfinished.

    Unlike an async generator, closing works before the first ``__anext__`` too,
    so a request that is never read is still aborted and its blocks freed.
    """

    def __init__(self, owner: AsyncLLM, request_id: str, q: asyncio.Queue):
        self.owner, self.request_id, self._q = owner, request_id, q
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._q.get()
        except BaseException:  # cancelled (client gone): abort before propagating
            await self.aclose()
            raise
        if isinstance(item, RequestFailedError):
            await self.aclose()
            raise item
        if isinstance(item, BaseException):
            await self.aclose()
            raise EngineDeadError(f"the engine loop has died: {item!r}") from item
        if item.finished:
            self._done = True
            self.owner._forget(self.request_id)
            failed = [c for c in item.outputs if c.finish_reason == "error"] if isinstance(item, RequestOutput) else []
            if failed:  # it alone failed in the engine (the others were served on)
                raise RequestFailedError(f"request {self.request_id} failed: {failed[0].stop_reason}")
        return item

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self.owner._forget(self.request_id)
            self.owner.abort(self.request_id)


class AsyncLLM:
    """``engine``: the engine, or a function that builds it. A function is called on the engine thread, so the
    engine's start-up warm-up runs on the thread that will step it: OpenMP keeps a thread team per calling
    thread, and the quantized linears a scratch buffer per thread, and a warm-up on another thread (the
    caller's) would leave the first request to set up its own. Building it raises here."""

    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        max_queue_len: int | None = None,
        on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
        on_restart: Callable[[], None] | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ):
        # the engine thread allocates from the main arena (pagedllm.malloc_arena: a thread arena faults its
        # activations in afresh each step); `pagedllm serve` has done this before any thread started
        share_main_arena()
        self.engine: LLMEngine  # set by the engine thread
        self.max_queue_len = max_queue_len
        self.on_step = on_step  # e.g. metrics; runs in the engine thread after each step
        self.on_restart = on_restart  # after each rebuild of the engine core (engine thread)
        self.on_dead = on_dead  # once the engine can serve no more (engine thread): e.g. stop the server
        self.restarting = False  # while the engine core is being rebuilt after a fault
        self._restarts: list[float] = []  # monotonic times of the rebuilds within RESTART_WINDOW_S
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._unapplied = 0  # children handed to the engine thread that it has not queued yet
        self._dead: BaseException | None = None
        self._pixels: PixelBudget | None = None  # decoded images in flight (a vision-language model's engine)
        self._stopping = False
        # one thread: HF tokenizers are not safe to share across threads, and one is enough to
        # keep the event loop free
        self._prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-prepare")
        # a request's images are fetched and decoded on threads of their own before its tokenization: a slow
        # URL holds up no other request's
        self._media = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pagedllm-media")
        # outputs go to the event loops from a thread of their own: waking a loop (call_soon_threadsafe)
        # cost the engine thread 0.7 ms a step in a served run (16 streams), waiting to get the GIL back
        # from the loop it had just woken; now this thread waits, and the loop's work runs while the
        # engine's next step computes without the GIL (the gap between steps: 1.3 -> 0.5 ms)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._courier = threading.Thread(target=self._carry, name="pagedllm-deliver", daemon=True)
        self._courier.start()
        built: concurrent.futures.Future[None] = concurrent.futures.Future()  # done once self.engine is set
        self._thread = threading.Thread(target=self._run, args=(engine, built), name="pagedllm-engine", daemon=True)
        self._thread.start()
        try:
            built.result()
        except BaseException:
            self._outbox.put(None)
            self._prep.shutdown(wait=False)
            self._media.shutdown(wait=False)
            raise

    @classmethod
    def from_kwargs(cls, max_queue_len: int | None = None, **kwargs: Any) -> AsyncLLM:
        config = EngineConfig.from_kwargs(**kwargs)  # a bad argument raises on the caller's thread
        return cls(lambda: LLMEngine(config), max_queue_len)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def dead(self) -> BaseException | None:
        """Why the engine can serve no more: its loop died, or (seen between steps) a worker did."""
        if self._dead is None:
            failure = self.engine.executor.failure()
            if failure is not None:
                return EngineDeadError(failure)
        return self._dead

    def num_queued(self) -> int:
        """Child requests accepted but not yet running (read without locking: an estimate)."""
        core = self.engine.core
        return self._unapplied + core.scheduler.num_waiting_requests() + core.num_waiting_for_grammar()

    async def prepare(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer-bound work (chat templates, tokenization) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._prep, fn, *args)

    async def add_requests(
        self,
        prompts: Sequence[PromptType],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: Any = None,
        trace_headers: dict[str, str] | None = None,
        max_tokens_must_fit: bool = False,
    ) -> list[RequestStream]:
        """Admit one user request of one or more prompts, all or nothing; a stream per prompt.

        ``max_tokens_must_fit``: refuse a max_tokens beyond a prompt's room in the context
        (the OpenAI server's rule) instead of cutting it.

        Raises at once on invalid input (InvalidParameterError) or a full queue
        (QueueFullError), before anything reaches the engine.
        """
        self._check_alive()
        request_id = request_id or uuid.uuid4().hex
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        size = len(prompts) * params.n
        self._check_room(size)  # a full queue answers before any tokenization
        held = [0]  # pixels of this request's decoded images, counted until the processor has made them features
        try:
            prompts = [await self._read_images(p, held) for p in prompts]
            prepared: list[PreparedRequest] = await self.prepare(
                lambda: [
                    self.engine.make_request(
                        rid,
                        p,
                        params,
                        priority,
                        group=request_id,
                        lora_request=lora_request,
                        trace_headers=trace_headers,
                        max_tokens_must_fit=max_tokens_must_fit,
                    )
                    for rid, p in zip(ids, prompts)
                ]
            )
        finally:
            if held[0]:
                assert self._pixels is not None  # only image prompts hold pixels
                self._pixels.release(held[0])
        return self._register(ids, prepared, size)

    async def _read_images(self, prompt: PromptType, held: list[int]) -> PromptType:
        """A prompt whose ``multi_modal_data`` images (URLs, bytes) are read into PIL images, all at once on the
        media threads; any other prompt as it is (the engine refuses images a text-only model is sent).

        Decoded images across all requests stay within ``max_pixels_in_flight``: a request first takes room for
        its images at the pixel limit (one atomic take, so no two requests hold part of the room each and wait
        for the rest), then gives back what its images did not use; ``held[0]`` counts what it keeps."""
        mm = self.engine.mm_processor
        if mm is None or not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None:
            return prompt
        assert self._pixels is not None  # made with the engine's multimodal processor
        items = mm.image_items(prompt["multi_modal_data"])
        want = min(len(items) * mm.config.max_image_pixels, self._pixels.capacity)
        await self._pixels.acquire(want)
        held[0] += want
        loop = asyncio.get_running_loop()
        images = await asyncio.gather(*(loop.run_in_executor(self._media, mm.load, x, i) for i, x in enumerate(items)))
        spare = want - min(want, sum(im.width * im.height for im in images))
        self._pixels.release(spare)
        held[0] -= spare
        return {**prompt, "multi_modal_data": {"image": list(images)}}

    async def encode(
        self,
        prompts: Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        trace_headers: dict[str, str] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embed one user request's prompts on a pooling model; one output per prompt, in order. They join the
        engine's steps like generation's requests (batched with other clients', under max_queue_len); raises
        at once on invalid input or a full queue. Cancelling aborts the prompts not yet computed."""
        self._check_alive()
        request_id = request_id or uuid.uuid4().hex
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        self._check_room(len(prompts), "inputs", "input")
        prepared = await self.prepare(
            lambda: self.engine.make_pooling_requests(
                ids, list(prompts), pooling_params, priority, group=request_id, trace_headers=trace_headers
            )
        )
        streams = self._register(ids, prepared, len(prompts))
        outs: list[EmbeddingRequestOutput] = []
        try:
            for stream in streams:
                async for out in stream:  # a pooling request's stream carries EmbeddingRequestOutputs
                    outs.append(cast("EmbeddingRequestOutput", out))
        finally:
            for stream in streams:
                await stream.aclose()
        return outs

    def _register(self, ids: list[str], prepared: list[PreparedRequest], size: int) -> list[RequestStream]:
        """One stream per request id, then the prepared requests to the engine thread (all or nothing)."""
        loop = asyncio.get_running_loop()
        streams = []
        with self._lock:  # the engine thread snapshots the streams under this lock when it dies
            self._check_alive()
            self._check_room(size)
            clash = [rid for rid in ids if rid in self._streams]
            if clash:
                raise InvalidParameterError(f"request id {clash[0]!r} is already in use", "request_id")
            for rid in ids:
                q: asyncio.Queue = asyncio.Queue()
                self._streams[rid] = (loop, q)
                streams.append(RequestStream(self, rid, q))
            self._unapplied += size
        self._commands.put(("add", prepared))
        return streams

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str | None = None, priority: int = 0
    ):
        """Yield cumulative outputs of one prompt until it finishes. Raises at once on invalid input."""
        (stream,) = await self.add_requests([prompt], sampling_params, request_id, priority)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """``fn(engine)`` on the engine thread, between two steps (engine state is touched by that thread only)."""
        self._check_alive()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float | None = 10.0) -> None:
        self._stopping = True
        self._commands.put(("stop",))
        self._thread.join(timeout)
        self._outbox.put(None)
        self._courier.join(timeout)
        self._prep.shutdown(wait=False, cancel_futures=True)
        self._media.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()  # the worker processes / Ray actors

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has died: {self._dead!r}")

    def _check_room(self, size: int, what: str = "prompts x n", param: str = "n") -> None:
        """``size`` sequences (``what`` they are, the request field to name) against max_queue_len."""
        limit = self.max_queue_len
        if limit is None:
            return
        if 0 < limit < size:  # could never be admitted: the client must split it, not retry
            raise InvalidParameterError(
                f"this request asks for {size} sequences ({what}), more than the server's queue holds "
                f"(max_queue_len={limit})",
                param,
            )
        queued = self.num_queued()
        if queued + size > limit:
            raise QueueFullError(
                f"the request queue is full ({queued} sequences waiting, this request adds "
                f"{size}, max_queue_len={limit}); retry later",
                "max_queue_len",
            )

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    # -- the engine thread ------------------------------------------------------
    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            for prepared in cmd[1]:
                with self._lock:
                    alive = prepared.request_id in self._streams
                if alive:  # the client may have gone before we got here
                    self.engine.add_prepared_request(prepared)
                with self._lock:  # after queuing: the count may be briefly high, never low
                    self._unapplied -= len(prepared.children)
        elif cmd[0] == "abort":
            self.engine.abort_request([cmd[1]])
        elif cmd[0] == "call":  # run on the engine thread, between steps; the caller awaits the future
            _, fn, fut = cmd
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except Exception as e:
                    fut.set_exception(e)

    def _run(self, engine: LLMEngine | Callable[[], LLMEngine], built: concurrent.futures.Future[None]) -> None:
        try:
            self.engine = engine if isinstance(engine, LLMEngine) else engine()
        except BaseException as e:  # raised to the constructor's caller
            built.set_exception(e)
            return
        mm = self.engine.mm_processor
        self._pixels = PixelBudget(mm.config.max_pixels_in_flight) if mm is not None else None
        built.set_result(None)
        try:
            while not self._stopping:
                busy = self.engine.has_unfinished_requests()
                try:
                    # sleep only when there is nothing to compute (a KV connector holding blocks for a peer wakes
                    # it now and then to free them once released or timed out)
                    cmd = self._commands.get(block=not busy, timeout=None if busy else self.engine.idle_wake_s())
                    while True:
                        if cmd[0] == "stop":
                            return
                        self._apply(cmd)
                        cmd = self._commands.get_nowait()
                except queue.Empty:
                    pass
                if not self.engine.has_unfinished_requests():
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as e:
                    if not self._restart(e):
                        raise
                    continue
                # one wake-up of each event loop per step, not one per output: each call_soon_threadsafe
                # is a write to the loop's self-pipe and a GIL hand-over (2.4 % of the engine thread's
                # samples at 16 streams, one call per output)
                batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
                with self._lock:
                    for out in outputs:
                        target = self._streams.get(out.request_id)
                        if target is not None:
                            batches.setdefault(target[0], []).append((target[1], out))
                for loop, items in batches.items():
                    self._outbox.put((loop, items))
                if self.on_step is not None:
                    self.on_step(self.engine, outputs)
        except BaseException as e:  # make every waiting stream fail instead of hanging
            logger.exception("engine loop died")
            with self._lock:
                self._dead = e
            self._fail_streams(e)
            if self.on_dead is not None:
                self.on_dead(e)

    def _fail_streams(self, error: BaseException) -> list[str]:
        """Every open stream ends with ``error``, after every output already on its way; the ids of those requests
        (every stream registered by then, whether or not its request reached the engine thread)."""
        with self._lock:
            targets = list(self._streams.items())
        for _, (loop, q) in targets:
            self._outbox.put((loop, [(q, error)]))
        return [rid for rid, _ in targets]

    def _restart(self, error: Exception) -> bool:
        """A step failed and no request could be blamed: fail every request in flight, then rebuild the engine
        core in this process. False (the engine dies) where it cannot be rebuilt, or after MAX_RESTARTS within
        RESTART_WINDOW_S: then something is wrong beyond one request."""
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(self._restarts) > MAX_RESTARTS or not self.engine.can_rebuild():
            return False
        logger.exception(
            "an engine step failed and no request could be blamed: failing the requests in flight and rebuilding "
            "the engine core (restart %d of at most %d in %.0f s)",
            len(self._restarts),
            MAX_RESTARTS,
            RESTART_WINDOW_S,
            exc_info=error,
        )
        self.restarting = True
        try:
            self._fail_streams(
                RequestFailedError(f"the engine failed while serving this request and restarted: {error!r}")
            )
            self.engine.rebuild()
        finally:
            self.restarting = False
        if self.on_restart is not None:
            self.on_restart()
        return True

    def _carry(self) -> None:
        """The courier thread: hands each step's outputs (and a dying engine's error) to their event loops,
        in the order the engine thread produced them."""
        while (batch := self._outbox.get()) is not None:
            try:
                _deliver_all(*batch)
            except Exception:  # never stop delivering: every later output would be lost with this thread
                logger.exception("could not hand outputs to an event loop")


class PixelBudget:
    """Pixels of decoded images in flight across all requests: a request waits up to ``wait_s`` for room (polled:
    the budget is shared by every event loop a process runs), then gets a QueueFullError (503, retry)."""

    def __init__(self, capacity: int, wait_s: float = 30.0):
        self.capacity, self.wait_s, self.used = capacity, wait_s, 0
        self._lock = threading.Lock()

    async def acquire(self, n: int) -> None:
        deadline = time.monotonic() + self.wait_s
        while True:
            with self._lock:
                if self.used + n <= self.capacity:
                    self.used += n
                    return
            if time.monotonic() > deadline:
                raise QueueFullError(
                    f"the server is decoding images of other requests ({self.used} pixels in flight, "
                    f"max_pixels_in_flight={self.capacity}); retry later",
                    "max_pixels_in_flight",
                )
            await asyncio.sleep(0.02)

    def release(self, n: int) -> None:
        with self._lock:
            self.used -= n
            assert self.used >= 0, "released more pixels than were taken"


def _deliver_all(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, Any]]) -> None:
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # that event loop has closed (shutdown): nobody is listening
        pass


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)
