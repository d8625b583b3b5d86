"""FastAPI app: OpenAI protocol models → SamplingParams → AsyncLLM → JSON or SSE.

The model loads in the background after the socket is up, so /health can say
503 until the engine is ready (what a Kubernetes readiness probe wants).

This module builds the app: middleware, error handlers, the loader and the lifespan. The endpoints live in
the ``serving_*`` route modules, which reach the :class:`ServerState` through one dependency
(``state.ServerStateDep``); what they share is in ``common`` and ``errors``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm import __version__
from pagedllm.engine.async_llm import AsyncLLM, QueueFullError
from pagedllm.entrypoints.openai import protocol as P
from pagedllm.entrypoints.openai import (
    serving_admin,
    serving_chat,
    serving_completions,
    serving_models,
    serving_pooling,
    serving_responses,
)
from pagedllm.entrypoints.openai.common import JSONBodyRoute
from pagedllm.entrypoints.openai.errors import (
    APIError,
    BodyError,
    error_response,
    json_error_message,
)
from pagedllm.entrypoints.openai.limits import OPEN_ENDPOINTS, RequestLimits
from pagedllm.entrypoints.openai.serving_chat import chat_prompt as _chat_prompt  # noqa: F401 (tests import it here)
from pagedllm.entrypoints.openai.state import ServerState
from pagedllm.errors import EngineDeadError, InvalidParameterError, RequestFailedError

__all__ = ["APIError", "ApiKeyGuard", "BodyLimit", "ServerState", "build_app", "error_response"]

logger = logging.getLogger("pagedllm")


class BodyLimit:
    """ASGI middleware: 413 for a body over the limit, counted as it streams in (chunked bodies
    have no Content-Length to check up front); 400 for a body that is not JSON; 408 for a body whose next chunk
    does not come within ``timeout`` seconds (a half-sent request is not held)."""

    def __init__(self, app: Any, max_bytes: int, timeout: float = 30.0):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await error_response(
                413,
                f"request body of {int(length)} bytes exceeds the limit of {self.max_bytes} bytes",
                "request_too_large",
            )(scope, receive, send)
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if ctype and not (ctype == b"application/json" or ctype.endswith(b"+json")):
            return await error_response(
                400, f"Content-Type must be application/json, got {ctype.decode('latin-1')!r}", "invalid_request_error"
            )(scope, receive, send)
        seen, whole = 0, False

        async def counted() -> dict:
            nonlocal seen, whole
            if whole:  # the body is in: what follows is a wait for the client's disconnect, untimed
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except TimeoutError:
                raise BodyError(408, f"the request body stalled: no data for {self.timeout:g} s") from None
            whole = message["type"] != "http.request" or not message.get("more_body", False)
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyError(413, f"request body exceeds the limit of {self.max_bytes} bytes")
            return message

        return await self.app(scope, counted, send)


class ApiKeyGuard:
    """ASGI middleware: 401 for a request without the server's API key, on every path but the open ones
    (``ServerState.open_endpoints``), unknown paths included. A plain ASGI class, not
    ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware passes every chunk of a streamed answer
    through a memory stream of its own. (With `merge_streams`' one-stream path, this took the event loop's CPU
    time in `benchmarks/serve_vs_offline.py`'s served run from 0.66 s to 0.42 s.)"""

    def __init__(self, app: Any, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        key = self.state.api_key
        if (
            key is not None
            and scope["type"] in ("http", "websocket")
            and scope["path"] not in self.state.open_endpoints
        ):
            supplied = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(supplied, f"Bearer {key}".encode()):
                return await error_response(401, "invalid or missing API key", "authentication_error")(
                    scope, receive, send
                )
        return await self.app(scope, receive, send)


def build_app(
    engine_factory: Callable[[], Any],
    served_model_name: str,
    api_key: str | None = None,
    max_queue_len: int | None = None,
    max_body_bytes: int = 4 << 20,
    limits: RequestLimits | None = None,
    on_ready: Callable[[], None] | None = None,
    trust_request_chat_template: bool = False,
    tool_call_parser: str | None = None,
    trace_file: str | None = None,
    otlp_traces_endpoint: str | None = None,
    lora_modules: dict[str, str] | None = None,
    allow_runtime_lora_updating: bool = False,
    engine_state_interval: float = 1.0,
    max_stored_responses: int = 1000,
    max_stored_response_bytes: int = 256 << 20,
    enable_prompt_tokens_details: bool = False,
    on_dead: Callable[[BaseException], None] | None = None,
    open_endpoints: tuple[str, ...] = OPEN_ENDPOINTS,
    request_body_timeout: float = 30.0,
) -> FastAPI:
    """``on_ready`` runs on the loader thread once the engine serves (/health answers 200).
    ``tool_call_parser`` (a name in TOOL_PARSERS) enables ``tool_choice: auto``; ``trace_file`` writes a
    Chrome / Perfetto trace of the engine's steps and requests; ``max_stored_responses`` bounds the Responses
    API's stored responses (least recently used evicted); ``enable_prompt_tokens_details`` adds
    ``usage.prompt_tokens_details.cached_tokens`` to completions and chat. ``on_dead`` runs once the engine can
    serve no more (its core failed beyond what a rebuild mends): `pagedllm serve` then exits non-zero.
    ``open_endpoints``: the exact paths that answer without ``api_key``."""
    state = ServerState(
        served_model_name,
        api_key,
        limits or RequestLimits(),
        trust_request_chat_template,
        tool_call_parser,
        keep_trace_context=bool(otlp_traces_endpoint),
        max_stored_responses=max_stored_responses,
        max_stored_response_bytes=max_stored_response_bytes,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
    )
    state.open_endpoints = frozenset(open_endpoints)

    tracer = None
    if trace_file:
        from pagedllm.engine.trace import ChromeTraceWriter

        tracer = ChromeTraceWriter(trace_file)

    otel = None
    if otlp_traces_endpoint:
        from pagedllm.engine.trace import OtelRequestTracer

        otel = OtelRequestTracer(otlp_traces_endpoint, served_model_name)

    def on_step(engine: Any, outputs: list) -> None:
        state.metrics.on_step(engine, outputs)
        for t in (tracer, otel):
            if t is not None:
                t.on_step(engine, outputs)

    def load() -> None:
        try:
            # built (and warmed up) on the engine thread; pooling models too
            state.llm = AsyncLLM(
                engine_factory,
                max_queue_len,
                on_step=on_step,
                on_restart=state.metrics.engine_restarts.inc,
                on_dead=on_dead,
            )
            for name, path in (lora_modules or {}).items():  # a bad adapter fails the start, with its reason
                state.add_lora(name, path)
        except BaseException as e:  # surfaced by /health and every endpoint
            logger.exception("engine failed to load")
            state.load_error = e
            return
        if on_ready is not None:
            on_ready()

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        logger.info("loading the model in the background; /health answers 503 until it is ready")
        threading.Thread(target=load, name="pagedllm-loader", daemon=True).start()
        yield
        if state.llm is not None:
            state.llm.shutdown()
        for t in (tracer, otel):
            if t is not None:
                t.close()

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan)
    app.router.route_class = JSONBodyRoute
    app.state.server = state
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout=request_body_timeout)
    app.add_middleware(ApiKeyGuard, state=state)  # added last, so it runs first: a 401 before any body check
    _add_error_handlers(app)

    state.hub = serving_admin.engine_state_hub(state, engine_state_interval)
    app.state.on_exit = [state.hub.close_soon]  # run by the server on SIGTERM / SIGINT: end the dashboards' streams

    app.include_router(serving_models.router)
    if allow_runtime_lora_updating:
        app.include_router(serving_models.lora_router)
    app.include_router(serving_admin.router)
    app.include_router(serving_pooling.router)
    app.include_router(serving_completions.router)
    app.include_router(serving_chat.router)
    app.include_router(serving_responses.router)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


# The errors the server answers with, in OpenAI's shape, as /openapi.json documents them (FastAPI's own default is
# a 422 in its own shape, which this server never sends: a validation error is a 400, as vLLM's and OpenAI's)
_ERRORS = {
    "400": "Invalid parameters, malformed JSON, or a body that is not JSON",
    "401": "A missing or wrong API key (with --api-key)",
    "404": "An unknown model, adapter, route or stored response",
    "408": "The request body stalled (--request-body-timeout)",
    "413": "A body over --max-request-body-bytes",
    "500": "This request failed inside the engine; the engine serves everyone else on",
    "503": "The queue is full, the model is loading, or the engine is restarting or dead (Retry-After where known)",
}


def _allowed_methods(app: FastAPI, path: str) -> str:
    """Every method the app's routes take at ``path`` (the documented operations whose template it matches)."""
    import re

    methods: set[str] = set()
    for template, ops in app.openapi()["paths"].items():
        if re.fullmatch(re.sub(r"\{[^/}]+\}", "[^/]+", template), path):
            methods |= {m.upper() for m in ops}
    return ", ".join(sorted(methods))


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema with every operation's documented errors set to what the server returns."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, model in (("ErrorInfo", P.ErrorInfo), ("ErrorResponse", P.ErrorResponse)):
        components[name] = model.model_json_schema(ref_template="#/components/schemas/{model}")
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    probes = {"/health": ("503",), "/metrics": (), "/version": ()}  # answer without the key, and take no input
    for path, ops in schema["paths"].items():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for code in probes.get(path, _ERRORS):
                responses.setdefault(code, {"description": _ERRORS[code], "content": error})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    state: ServerState = app.state.server
    if state.api_key is not None:  # what needs the key says so, as a bearer scheme
        schema["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
        for path, ops in schema["paths"].items():
            if path not in state.open_endpoints:
                for op in ops.values():
                    op["security"] = [{"apiKey": []}]
    app.openapi_schema = schema
    return schema


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in the OpenAI shape."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return error_response(400, json_error_message(exc.body, first), "invalid_request_error")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = "; ".join(
            f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}" for e in errs[:5]
        )
        return error_response(400, msg or "invalid request", "invalid_request_error", ".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        """Body errors (ours and FastAPI's) and unknown routes, in the OpenAI error shape."""
        type_ = {404: "NotFoundError", 413: "request_too_large"}.get(exc.status_code, "invalid_request_error")
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:  # Starlette names the first route of the path only; a path may have several
            headers = {**(headers or {}), "Allow": _allowed_methods(app, request.url.path)}
        return error_response(exc.status_code, str(exc.detail), type_, getattr(exc, "param", None), headers)

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.headers)

    @app.exception_handler(QueueFullError)
    async def _queue_full(_: Request, exc: QueueFullError):
        return error_response(503, str(exc), "server_overloaded", None, {"Retry-After": "1"})

    @app.exception_handler(InvalidParameterError)
    async def _invalid(_: Request, exc: InvalidParameterError):
        return error_response(400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError):
        return error_response(503, str(exc), "engine_dead")

    @app.exception_handler(RequestFailedError)
    async def _failed(_: Request, exc: RequestFailedError):
        return error_response(500, str(exc), "server_error")
