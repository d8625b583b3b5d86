"""Request handling the route modules share: JSON bodies parsed (and limit-checked) off the event loop when
large, collecting or streaming (SSE) a request's outputs, usage and logprob formatting."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute

from pagedllm.engine.async_llm import RequestStream
from pagedllm.entrypoints.openai import protocol as P
from pagedllm.entrypoints.openai.errors import BodyError
from pagedllm.entrypoints.openai.limits import RequestLimits
from pagedllm.errors import EngineDeadError, InvalidParameterError, RequestFailedError
from pagedllm.outputs import RequestOutput

logger = logging.getLogger("pagedllm")

T = TypeVar("T")

# -- request bodies ---------------------------------------------------------------------

# Bodies larger than this are parsed and limit-checked on a worker thread. (The C JSON parser still
# holds the GIL while it runs, ~25 ms per MiB; --max-request-body-bytes bounds that.)
_OFF_LOOP_JSON_BYTES = 64 << 10


class _Request(Request):
    """Parses JSON and checks the request limits on it, on the server's parsing thread when the body is large."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            state = self.scope["app"].state.server
            self._json = (
                await asyncio.get_running_loop().run_in_executor(state.json_pool, _parse_body, body, state.limits)
                if len(body) > _OFF_LOOP_JSON_BYTES
                else _parse_body(body, state.limits)
            )
        return self._json


def _parse_body(body: bytes, limits: RequestLimits) -> Any:
    try:
        obj = json.loads(body)  # a json.JSONDecodeError becomes FastAPI's json_invalid, with its position
    except RecursionError:
        raise BodyError(400, "the JSON body is nested too deeply") from None
    except UnicodeDecodeError as e:
        raise BodyError(400, f"the body is not valid UTF-8 (invalid byte at position {e.start})") from None
    if _SURROGATE_ESCAPE.search(body):  # only an escape can put one in: raw surrogate bytes are not UTF-8
        where = _lone_surrogate(obj)
        if where is not None:
            raise BodyError(
                400, f"{where or 'body'}: a string holds a lone UTF-16 surrogate: not valid Unicode", where or None
            )
    try:
        limits.check(obj)
    except InvalidParameterError as e:
        raise BodyError(400, str(e), e.param) from None
    return obj


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(obj: Any) -> str | None:
    """The dotted path of the first string (or key) that is not valid Unicode, else None (iteratively: the body
    may nest deeply). A surrogate pair's escapes decode to one character and pass."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        node, path = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            sub = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not _valid(key):
                return path
            if isinstance(value, str):
                if not _valid(value):
                    return sub
            elif isinstance(value, dict | list):
                stack.append((value, sub))
        if isinstance(node, str) and not _valid(node):
            return path
    return None


def _valid(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class ClientDisconnected(Exception):
    """The client of a request that is answered whole went away first: its work is aborted (run_to_end,
    unless_disconnected) and the route ends quietly. Any client can cause it, so it is no server error."""


class JSONBodyRoute(APIRoute):
    """FastAPI's route, reading JSON bodies through :class:`_Request`. Every router of the server uses it
    (``include_router`` keeps each route's own class); a request whose client left is ended here with one line
    (499, nginx's 'client closed request', which nobody reads) instead of an error's traceback."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(_Request(request.scope, request.receive))
            except ClientDisconnected:
                logger.info("%s %s: the client went away; its request was aborted", request.method, request.url.path)
                return Response(status_code=499)

        return route


# -- collecting and streaming outputs ---------------------------------------------------


async def run_to_end(streams: list[RequestStream], raw: Request) -> list[RequestOutput]:
    """Collect final outputs; abort everything if the client goes away meanwhile."""

    async def drain(s):
        last = None
        async for out in s:
            last = out
        return last

    tasks = [asyncio.ensure_future(drain(s)) for s in streams]
    try:
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=0.5)
            if await raw.is_disconnected():
                raise ClientDisconnected
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()


async def unless_disconnected(work: Awaitable[T], raw: Request) -> T:
    """``work``'s result; cancelled (and so aborted: a cancelled ``encode`` closes its streams) if the client goes
    away first: nothing a client asked for outlives it."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait([task], timeout=0.5)
            if not task.done() and await raw.is_disconnected():
                raise ClientDisconnected
        return task.result()
    finally:
        task.cancel()


def sse_response(gen: AsyncIterator[str]) -> StreamingResponse:
    async def guarded() -> AsyncIterator[str]:
        try:
            async for chunk in gen:
                yield chunk
        except (EngineDeadError, RequestFailedError) as e:  # headers are gone: say it in the stream, as vLLM does
            code = 503 if isinstance(e, EngineDeadError) else 500
            err = {"error": {"message": str(e), "type": type(e).__name__, "code": code}}
            yield f"data: {json.dumps(err)}\n\n"
            yield "data: [DONE]\n\n"

    return StreamingResponse(
        guarded(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


def sse_event(obj: Any) -> str:
    return f"data: {obj.model_dump_json(exclude_unset=False)}\n\n"


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as outputs arrive, tagged by their index."""
    if len(streams) == 1:  # the usual case: no pump task and queue between the stream and its reader
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for out in s:
                await q.put((i, out))
        except (EngineDeadError, RequestFailedError) as e:  # the stream ends with an error event
            await q.put((i, e))
        finally:
            await q.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            i, out = await q.get()
            if out is None:
                live -= 1
                continue
            if isinstance(out, BaseException):
                raise out
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()


# -- usage and logprobs -----------------------------------------------------------------


def usage_info(finals: list[RequestOutput], details: bool = False) -> P.UsageInfo:
    """Token counts; with ``details`` (--enable-prompt-tokens-details) also the prompt tokens the prefix cache
    (or a KV tier) supplied instead of computing them, as OpenAI's ``prompt_tokens_details.cached_tokens``."""
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    cached = P.PromptTokenUsageInfo(cached_tokens=sum(max(o.num_cached_tokens, 0) for o in finals)) if details else None
    return P.UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=cached,
    )


def _top(entry: dict, n: int) -> list:
    """The top-n alternatives of one token's logprobs (the engine stores them first, by rank)."""
    return list(entry.values())[:n]


def completion_logprobs(c, offset: int, n: int, start: int = 0) -> P.CompletionLogprobs:
    lp = P.CompletionLogprobs()
    for tid, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        text = entry[tid].decoded_token or ""  # decoded once, by the output processor
        lp.tokens.append(text)
        lp.token_logprobs.append(entry[tid].logprob)
        lp.top_logprobs.append({(v.decoded_token or ""): v.logprob for v in _top(entry, n)})
        lp.text_offset.append(offset)
        offset += len(text)
    return lp


def chat_logprobs(c, n: int, start: int = 0) -> P.ChatLogprobs:
    content = []
    for tid, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        text = entry[tid].decoded_token or ""
        content.append(
            P.ChatTokenLogprob(
                token=text,
                logprob=entry[tid].logprob,
                bytes=list(text.encode()),
                top_logprobs=[
                    P.TopLogprob(
                        token=v.decoded_token or "", logprob=v.logprob, bytes=list((v.decoded_token or "").encode())
                    )
                    for v in _top(entry, n)
                ],
            )
        )
    return P.ChatLogprobs(content=content)
