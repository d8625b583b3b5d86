"""FastAPI app: OpenAI protocol models → SamplingParams → AsyncLLM → JSON or SSE.

The model loads in the background after the socket is up, so /health can say
503 until the engine is ready (what a Kubernetes readiness probe wants).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm import __version__
from pagedllm.engine.async_llm import AsyncLLM, QueueFullError, RequestStream
from pagedllm.entrypoints.openai import protocol as P
from pagedllm.entrypoints.openai.dashboard import EngineStateHub, dashboard_html
from pagedllm.entrypoints.openai.limits import RequestLimits
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.errors import EngineDeadError, InvalidParameterError
from pagedllm.lora import LoRARequest
from pagedllm.outputs import RequestOutput

logger = logging.getLogger("pagedllm")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = P.ErrorResponse(error=P.ErrorInfo(message=message, type=type_, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


# Bodies larger than this are parsed and limit-checked on a worker thread. (The C JSON parser still
# holds the GIL while it runs, ~25 ms per MiB; --max-request-body-bytes bounds that.)
_OFF_LOOP_JSON_BYTES = 64 << 10


class BodyError(HTTPException):
    """A body that cannot be accepted as it is: unparsable, or over a request limit."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(status, message)
        self.param = param


class _Request(Request):
    """Parses JSON and checks the request limits on it, on a worker thread when the body is large."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            limits = self.scope["app"].state.server.limits
            self._json = (await asyncio.to_thread(_parse_body, body, limits) if len(body) > _OFF_LOOP_JSON_BYTES
                          else _parse_body(body, limits))
        return self._json


def _parse_body(body: bytes, limits: RequestLimits) -> Any:
    try:
        obj = json.loads(body)  # a json.JSONDecodeError becomes FastAPI's json_invalid, with its position
    except RecursionError:
        raise BodyError(400, "the JSON body is nested too deeply") from None
    except UnicodeDecodeError as e:
        raise BodyError(400, f"the body is not valid UTF-8 (invalid byte at position {e.start})") from None
    try:
        limits.check(obj)
    except InvalidParameterError as e:
        raise BodyError(400, str(e), e.param) from None
    return obj


class _Route(APIRoute):
    """FastAPI's route, reading JSON bodies through :class:`_Request`."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_Request(request.scope, request.receive))

        return route


class BodyLimit:
    """ASGI middleware: 413 for a body over the limit, counted as it streams in (chunked bodies
    have no Content-Length to check up front); 400 for a body that is not JSON."""

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await error_response(413, f"request body of {int(length)} bytes exceeds the limit of "
                                             f"{self.max_bytes} bytes", "request_too_large")(scope, receive, send)
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if ctype and not (ctype == b"application/json" or ctype.endswith(b"+json")):
            return await error_response(400, f"Content-Type must be application/json, got "
                                             f"{ctype.decode('latin-1')!r}", "invalid_request_error")(
                scope, receive, send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyError(413, f"request body exceeds the limit of {self.max_bytes} bytes")
            return message

        return await self.app(scope, counted, send)


class ApiKeyGuard:
    """ASGI middleware: 401 for a /v1 request without the server's API key. A plain ASGI class, not
    ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware passes every chunk of a streamed answer
    through a memory stream of its own. (With `_merge`'s one-stream path, this took the event loop's CPU
    time in `benchmarks/serve_vs_offline.py`'s served run from 0.66 s to 0.42 s.)"""

    def __init__(self, app: Any, state: "ServerState"):
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        key = self.state.api_key
        if key is not None and scope["type"] == "http" and scope["path"].startswith("/v1"):
            supplied = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(supplied, f"Bearer {key}".encode()):
                return await error_response(401, "invalid or missing API key", "authentication_error")(
                    scope, receive, send)
        return await self.app(scope, receive, send)


class ServerState:
    """What the endpoints share; `llm` is None until the engine has loaded."""

    def __init__(self, served_model_name: str, api_key: str | None, limits: RequestLimits,
                 trust_request_chat_template: bool = False, tool_call_parser: str | None = None):
        from pagedllm.entrypoints.openai.tool_calls import TOOL_PARSERS

        self.tool_parser = TOOL_PARSERS[tool_call_parser]() if tool_call_parser else None
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.limits = limits
        self.trust_request_chat_template = trust_request_chat_template
        self.llm: AsyncLLM | None = None
        self.metrics = ServerMetrics(served_model_name)
        self.load_error: BaseException | None = None
        self.loras: dict[str, LoRARequest] = {}  # adapter name -> request (the `model` field selects one)
        self.lora_lock = asyncio.Lock()
        self._lora_ids = itertools.count(1)

    def add_lora(self, name: str, path: str) -> LoRARequest:
        """Register an adapter (checked and loaded by the engine first)."""
        if name == self.served_model_name or name in self.loras:
            raise InvalidParameterError(f"a model or adapter named {name!r} is already served", "lora_name")
        req = LoRARequest(name, next(self._lora_ids), path)
        self.llm.engine.check_lora(req)
        self.loras[name] = req
        return req


def build_app(engine_factory: Callable[[], Any], served_model_name: str, api_key: str | None = None,
              max_queue_len: int | None = None, max_body_bytes: int = 4 << 20,
              limits: RequestLimits | None = None, on_ready: Callable[[], None] | None = None,
              trust_request_chat_template: bool = False, tool_call_parser: str | None = None,
              trace_file: str | None = None, otlp_traces_endpoint: str | None = None,
              lora_modules: dict[str, str] | None = None, allow_runtime_lora_updating: bool = False,
              engine_state_interval: float = 1.0) -> FastAPI:
    """``on_ready`` runs on the loader thread once the engine serves (/health answers 200).
    ``tool_call_parser`` (a name in TOOL_PARSERS) enables ``tool_choice: auto``; ``trace_file`` writes a
    Chrome / Perfetto trace of the engine's steps and requests."""
    state = ServerState(served_model_name, api_key, limits or RequestLimits(), trust_request_chat_template,
                        tool_call_parser)

    tracer = None
    if trace_file:
        from pagedllm.engine.trace import ChromeTraceWriter

        tracer = ChromeTraceWriter(trace_file)

    otel = None
    if otlp_traces_endpoint:
        from pagedllm.engine.trace import OtelRequestTracer

        otel = OtelRequestTracer(otlp_traces_endpoint, served_model_name)

    def trace_headers(raw: Request) -> dict[str, str] | None:
        """The client's W3C trace context (``traceparent``, ``tracestate``), kept only when spans are exported."""
        if otel is None:
            return None
        got = {k: v for k in ("traceparent", "tracestate") if (v := raw.headers.get(k)) and len(v) <= 512}
        return got or None

    def on_step(engine: Any, outputs: list) -> None:
        state.metrics.on_step(engine, outputs)
        for t in (tracer, otel):
            if t is not None:
                t.on_step(engine, outputs)

    def load() -> None:
        try:
            engine = engine_factory()
            state.llm = AsyncLLM(engine, max_queue_len, on_step=on_step)  # pooling models too
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
    app.router.route_class = _Route
    app.state.server = state
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(ApiKeyGuard, state=state)  # added last, so it runs first: a 401 before any body check

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return error_response(400, _json_error_message(exc.body, first), "invalid_request_error")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
                        for e in errs[:5])
        return error_response(400, msg or "invalid request", "invalid_request_error", ".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        """Body errors (ours and FastAPI's) and unknown routes, in the OpenAI error shape."""
        type_ = {404: "NotFoundError", 413: "request_too_large"}.get(exc.status_code, "invalid_request_error")
        return error_response(exc.status_code, str(exc.detail), type_, getattr(exc, "param", None),
                              getattr(exc, "headers", None))

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

    def engine() -> AsyncLLM:
        if state.llm is None:
            if state.load_error is not None:
                raise APIError(503, f"the model failed to load: {state.load_error}", "engine_dead")
            raise APIError(503, "the model is still loading", "model_loading", headers={"Retry-After": "5"})
        return state.llm

    def generator() -> AsyncLLM:
        llm = engine()
        if llm.engine.is_pooling:
            raise APIError(400, f"`{state.served_model_name}` is a pooling model: use /v1/embeddings, /score or "
                           "/rerank", "invalid_request_error", "model")
        return llm

    def pooler() -> Any:
        llm = engine()
        if not llm.engine.is_pooling:
            raise APIError(400, f"`{state.served_model_name}` generates text; embeddings and scores need a pooling "
                           "model (pagedllm serve MODEL --runner pooling)", "invalid_request_error", "model")
        return llm

    async def pool(llm: Any, prompts: list, truncate: int | None) -> tuple[list[list[int]], list]:
        from pagedllm.pooling_params import PoolingParams

        outs = await llm.encode(prompts, PoolingParams(truncate_prompt_tokens=truncate))
        return [o.prompt_token_ids for o in outs], [o.outputs.embedding for o in outs]

    def check_model(name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model); 404 for an unknown name."""
        if name is None or name == state.served_model_name:
            return None
        if name in state.loras:
            return state.loras[name]
        served = ", ".join(f"`{n}`" for n in [state.served_model_name, *state.loras])
        raise APIError(404, f"the model `{name}` does not exist; this server serves {served}", "NotFoundError",
                       "model")

    # -- probes and info --------------------------------------------------------
    @app.get("/health")
    async def health():
        if state.llm is None or state.llm.dead is not None:
            return error_response(503, "not ready" if state.load_error is None else str(state.load_error),
                                  "model_loading" if state.load_error is None else "engine_dead")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models", response_model=P.ModelList)
    async def models():
        max_len = state.llm.engine.max_model_len if state.llm else None
        cards = [P.ModelCard(id=state.served_model_name, max_model_len=max_len)]
        cards += [P.ModelCard(id=name, root=req.lora_path, parent=state.served_model_name, max_model_len=max_len)
                  for name, req in state.loras.items()]
        return P.ModelList(data=cards)

    if allow_runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(req: P.LoadLoRAAdapterRequest):
            llm = generator()
            if llm.engine.lora_cache is None:
                raise APIError(400, "this server was started without --enable-lora", "invalid_request_error",
                               "lora_name")
            async with state.lora_lock:  # one at a time: the name check and the registration go together
                await llm.prepare(state.add_lora, req.lora_name, req.lora_path)  # reads the files off the loop
            return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(req: P.UnloadLoRAAdapterRequest):
            lora = state.loras.pop(req.lora_name, None)
            if lora is None:
                raise APIError(404, f"no LoRA adapter named `{req.lora_name}` is loaded", "NotFoundError",
                               "lora_name")
            # requests already running with it finish with it; it leaves the memory cache now
            generator().engine.lora_cache.remove(lora.lora_int_id)
            return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")

    async def take_state(check: bool = False) -> dict:
        def take(e: Any) -> dict:  # on the engine thread, between two steps
            state.metrics.engine_state_snapshots.inc()
            return {**e.core.snapshot(check=check), **state.metrics.recent(), "model": state.served_model_name}
        return await engine().call(take)  # pooling models too

    hub = EngineStateHub(take_state, engine_state_interval)
    app.state.on_exit = [hub.close_soon]  # run by the server on SIGTERM / SIGINT: end the dashboards' streams

    @app.get("/v1/engine/state", response_model=None)
    async def engine_state(check: bool = False):
        """A snapshot of the engine (taken between two steps): KV block map, queues, the last steps' batches,
        the latest latencies and running totals; ``?check=true`` also checks the block pool's invariants."""
        return await take_state(check)

    @app.get("/v1/engine/state/stream", response_model=None)
    async def engine_state_stream():
        """The same snapshot as Server-Sent Events, one per interval, shared by every watcher."""
        engine()  # 503 while loading
        if hub.closed:
            raise APIError(503, "the server is shutting down", "server_overloaded")
        if hub.full:
            raise APIError(503, f"{hub.max_watchers} clients already watch the engine state", "server_overloaded",
                           headers={"Retry-After": "5"})
        return StreamingResponse(hub.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/dashboard", response_model=None)
    async def dashboard():
        """The live dashboard (its data comes from /v1/engine/state/stream, behind the API key)."""
        from fastapi.responses import HTMLResponse

        return HTMLResponse(dashboard_html(), headers={"Cache-Control": "no-cache"})

    # -- pooling models ------------------------------------------------------------
    @app.post("/v1/embeddings", response_model=None)
    async def embeddings(req: P.EmbeddingRequest):
        llm = pooler()
        check_model(req.model)
        inp = req.input
        if isinstance(inp, str):
            prompts: list = [inp]
        elif inp and all(isinstance(x, int) for x in inp):
            prompts = [{"prompt_token_ids": inp}]
        else:
            prompts = [x if isinstance(x, str) else {"prompt_token_ids": x} for x in inp]
        if not prompts:
            raise APIError(400, "input is empty", "invalid_request_error", "input")
        size = llm.engine.hidden_size
        if req.dimensions is not None and req.dimensions != size:
            raise APIError(400, f"dimensions={req.dimensions}: this model's embeddings have {size} dimensions "
                           "and it is not a Matryoshka model", "invalid_request_error", "dimensions")
        ids, vectors = await pool(llm, prompts, req.truncate_prompt_tokens)
        data = []
        for i, v in enumerate(vectors):
            if req.encoding_format == "base64":
                import base64

                import numpy as np

                emb: list[float] | str = base64.b64encode(np.asarray(v, dtype=np.float32).tobytes()).decode()
            else:
                emb = v
            data.append(P.EmbeddingData(index=i, embedding=emb))
        n = sum(map(len, ids))
        return P.EmbeddingResponse(id=P.random_id("embd"), model=req.model or state.served_model_name, data=data,
                                   usage=P.PoolingUsage(prompt_tokens=n, total_tokens=n))

    async def _similarities(llm: Any, text_1: str | list[str], text_2: str | list[str], truncate: int | None
                            ) -> tuple[list[float], int]:
        from pagedllm.engine.pooling import pair_scores, score_texts

        ids, vectors = await pool(llm, score_texts(text_1, text_2), truncate)
        return pair_scores(vectors), sum(map(len, ids))

    @app.post("/score", response_model=None)
    async def score(req: P.ScoreRequest):
        llm = pooler()
        check_model(req.model)
        scores, n = await _similarities(llm, req.text_1, req.text_2, req.truncate_prompt_tokens)
        return P.ScoreResponse(id=P.random_id("score"), model=req.model or state.served_model_name,
                               data=[P.ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                               usage=P.PoolingUsage(prompt_tokens=n, total_tokens=n))

    @app.post("/rerank", response_model=None)
    @app.post("/v1/rerank", response_model=None)
    async def rerank(req: P.RerankRequest):
        llm = pooler()
        check_model(req.model)
        scores, n = await _similarities(llm, req.query, req.documents, req.truncate_prompt_tokens)
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or len(scores)]
        return P.RerankResponse(id=P.random_id("rerank"), model=req.model or state.served_model_name,
                                usage=P.PoolingUsage(prompt_tokens=n, total_tokens=n),
                                results=[P.RerankResult(index=i, document=P.RerankDocument(text=req.documents[i]),
                                                        relevance_score=scores[i]) for i in ranked])

    @app.post("/tokenize", response_model=P.TokenizeResponse)
    async def tokenize(req: P.TokenizeRequest):
        llm = engine()
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of `prompt` or `messages`", "invalid_request_error", "prompt")
        tok = llm.tokenizer
        if req.messages is not None:
            ids = await llm.prepare(_chat_ids, tok, req.messages, None, req.add_generation_prompt, None)
        else:
            ids = await llm.prepare(lambda: tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        return P.TokenizeResponse(count=len(ids), max_model_len=llm.engine.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=P.DetokenizeResponse)
    async def detokenize(req: P.DetokenizeRequest):
        llm = engine()
        check_model(req.model)
        vocab = llm.engine.hf_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", "invalid_request_error", "tokens")
        return P.DetokenizeResponse(prompt=await llm.prepare(llm.tokenizer.decode, req.tokens))

    # -- completions --------------------------------------------------------------
    @app.post("/v1/completions", response_model=None)
    async def completions(req: P.CompletionRequest, raw: Request):
        llm = generator()
        lora = check_model(req.model)
        prompts = _completion_prompts(req.prompt)
        params = req.to_sampling_params()
        rid = P.random_id("cmpl")
        streams = await llm.add_requests(prompts, params, rid, req.priority, lora_request=lora,
                                         trace_headers=trace_headers(raw), max_tokens_must_fit=True)
        if lora is not None:
            state.metrics.lora_requests.labels(state.served_model_name, lora.lora_name).inc(len(prompts))
        tok = llm.tokenizer
        if req.stream:
            return _sse(_completion_chunks(rid, req.model or state.served_model_name, req, streams, tok))
        finals = await _run_to_end(streams, raw)
        choices = []
        for i, out in enumerate(finals):
            prefix = (out.prompt if out.prompt is not None else tok.decode(out.prompt_token_ids)) if req.echo else ""
            for c in out.outputs:
                choices.append(P.CompletionChoice(
                    index=i * req.n + c.index, text=prefix + c.text, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=_completion_logprobs(c, len(prefix), req.logprobs)
                    if req.logprobs is not None else None))
        return P.CompletionResponse(id=rid, model=req.model or state.served_model_name, choices=choices,
                                    usage=_usage(finals))

    # -- chat -------------------------------------------------------------------
    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: P.ChatCompletionRequest, raw: Request):
        llm = generator()
        lora = check_model(req.model)
        if req.chat_template is not None and not state.trust_request_chat_template:
            # a Jinja template runs arbitrary loops and string arithmetic on the server
            raise APIError(400, "chat_template in a request needs the server flag --trust-request-chat-template",
                           "invalid_request_error", "chat_template")
        params = req.to_sampling_params()
        choice = req.resolved_tool_choice()
        if choice == "auto" and state.tool_parser is None:
            raise APIError(400, 'tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                           '--tool-call-parser; or ask for "required" or a named function', "invalid_request_error",
                           "tool_choice")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and choice != "none" else None
        ids = await llm.prepare(_chat_ids, llm.tokenizer, req.messages, req.chat_template,
                                req.add_generation_prompt, req.chat_template_kwargs, tools)
        rid = P.random_id("chatcmpl")
        streams = await llm.add_requests([{"prompt_token_ids": ids}], params, rid, req.priority, lora_request=lora,
                                         trace_headers=trace_headers(raw), max_tokens_must_fit=True)
        if lora is not None:
            state.metrics.lora_requests.labels(state.served_model_name, lora.lora_name).inc()
        if req.stream:
            return _sse(_chat_chunks(rid, req.model or state.served_model_name, req, streams[0], choice,
                                    state.tool_parser))
        finals = await _run_to_end(streams, raw)
        choices = []
        for c in finals[0].outputs:
            content, calls, finish = _tool_answer(c.text, c.finish_reason, choice, state.tool_parser)
            message = P.ChatResponseMessage(content=content, tool_calls=[P.ToolCall(**x.to_openai()) for x in calls])
            choices.append(P.ChatChoice(
                index=c.index, message=message, finish_reason=finish, stop_reason=c.stop_reason,
                logprobs=_chat_logprobs(c, req.top_logprobs or 0) if req.logprobs else None))
        return P.ChatCompletionResponse(id=rid, model=req.model or state.served_model_name, choices=choices,
                                        usage=_usage(finals))

    return app


# -- helpers ------------------------------------------------------------------------

def _completion_prompts(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "invalid_request_error", "prompt")
    if all(isinstance(x, int) for x in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    if all(isinstance(x, str) for x in prompt):
        return list(prompt)
    if all(isinstance(x, list) for x in prompt):
        return [{"prompt_token_ids": x} for x in prompt]
    raise APIError(400, "prompt must be a string, a list of strings, or token ids", "invalid_request_error", "prompt")


def _json_error_message(doc: Any, err: dict) -> str:
    """'malformed JSON body at line L, column C (character P): reason', positions as a user counts them."""
    pos = err.get("loc", (None, None))[-1]
    reason = (err.get("ctx") or {}).get("error", "invalid JSON")
    if not isinstance(pos, int) or not isinstance(doc, str):
        return f"malformed JSON body: {reason}"
    line = doc.count("\n", 0, pos) + 1
    column = pos - (doc.rfind("\n", 0, pos) + 1) + 1
    return f"malformed JSON body at line {line}, column {column} (character {pos + 1}): {reason}"


def _tool_answer(text: str, finish_reason: str | None, choice: Any, parser: Any) -> tuple[str | None, list, Any]:
    """(content, tool calls, finish_reason) of a finished answer under ``choice``."""
    from pagedllm.entrypoints.openai.tool_calls import parse_forced

    if choice == "none":
        return text, [], finish_reason
    if choice == "auto":
        content, calls = parser.extract(text)
    else:
        calls = parse_forced(text, choice)
        content = None if calls else text or None  # cut short (length): the partial answer, as text
    named = isinstance(choice, dict)  # OpenAI answers a forced function with finish_reason "stop"
    return content, calls, ("tool_calls" if calls and not named and finish_reason == "stop" else finish_reason)


def _chat_ids(tok: Any, messages: list[P.ChatMessage], template: str | None, add_generation_prompt: bool,
              kwargs: dict | None, tools: list[dict] | None = None) -> list[int]:
    if template is None and getattr(tok, "chat_template", None) is None:
        raise APIError(400, "this model has no chat template; pass `chat_template`", "invalid_request_error",
                       "chat_template")
    conv = []
    for m in messages:
        content = m.content
        if isinstance(content, list):  # OpenAI content parts: only text is supported
            texts = []
            for part in content:
                if part.get("type") != "text":
                    raise APIError(400, f"unsupported content part type {part.get('type')!r}; only 'text'",
                                   "invalid_request_error", "messages")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        conv.append({**m.model_dump(exclude_none=True), "content": content or ""})
    try:
        text = tok.apply_chat_template(conv, chat_template=template, tokenize=False, tools=tools,
                                       add_generation_prompt=add_generation_prompt, **(kwargs or {}))
    except Exception as e:  # a template error is the request's fault (bad roles, bad template)
        raise APIError(400, f"chat template failed: {e}", "invalid_request_error", "messages") from e
    return tok.encode(text, add_special_tokens=False)


async def _run_to_end(streams: list[RequestStream], raw: Request) -> list[RequestOutput]:
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
                raise asyncio.CancelledError("client disconnected")
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()


def _usage(finals: list[RequestOutput]) -> P.UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _top(entry: dict, n: int) -> list:
    """The top-n alternatives of one token's logprobs (the engine stores them first, by rank)."""
    return list(entry.values())[:n]


def _completion_logprobs(c, offset: int, n: int, start: int = 0) -> P.CompletionLogprobs:
    lp = P.CompletionLogprobs()
    for tid, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        text = entry[tid].decoded_token or ""  # decoded once, by the output processor
        lp.tokens.append(text)
        lp.token_logprobs.append(entry[tid].logprob)
        lp.top_logprobs.append({(v.decoded_token or ""): v.logprob for v in _top(entry, n)})
        lp.text_offset.append(offset)
        offset += len(text)
    return lp


def _chat_logprobs(c, n: int, start: int = 0) -> P.ChatLogprobs:
    content = []
    for tid, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        text = entry[tid].decoded_token or ""
        content.append(P.ChatTokenLogprob(
            token=text, logprob=entry[tid].logprob, bytes=list(text.encode()),
            top_logprobs=[P.TopLogprob(token=v.decoded_token or "", logprob=v.logprob,
                                       bytes=list((v.decoded_token or "").encode())) for v in _top(entry, n)]))
    return P.ChatLogprobs(content=content)


def _sse(gen: AsyncIterator[str]) -> StreamingResponse:
    async def guarded() -> AsyncIterator[str]:
        try:
            async for chunk in gen:
                yield chunk
        except EngineDeadError as e:  # headers are gone already: say it in the stream, as vLLM does
            err = {"error": {"message": str(e), "type": "EngineDeadError", "code": 503}}
            yield f"data: {json.dumps(err)}\n\n"
            yield "data: [DONE]\n\n"

    return StreamingResponse(guarded(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _data(obj: Any) -> str:
    return f"data: {obj.model_dump_json(exclude_unset=False)}\n\n"


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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
        except EngineDeadError as e:  # the engine died mid-request: the stream ends with an error event
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


async def _completion_chunks(rid, model, req: P.CompletionRequest, streams, tok) -> AsyncIterator[str]:
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in _merge(streams):
        for c in out.outputs:
            idx = i * req.n + c.index
            if idx in done:
                continue
            first_chunk = idx not in sent_text
            prefix = ""
            if req.echo and first_chunk:
                prefix = out.prompt if out.prompt is not None else tok.decode(out.prompt_token_ids)
            delta = c.text[sent_text.get(idx, 0):]
            if not delta and not prefix and not c.finished():
                continue
            lp = (_completion_logprobs(c, sent_text.get(idx, 0), req.logprobs, sent_tokens.get(idx, 0))
                  if req.logprobs is not None else None)
            sent_text[idx], sent_tokens[idx] = len(c.text), len(c.token_ids)
            if c.finished():
                done.add(idx)
            choice = P.CompletionChoice(index=idx, text=prefix + delta, logprobs=lp, finish_reason=c.finish_reason,
                                        stop_reason=c.stop_reason)
            yield _data(P.CompletionResponse(id=rid, model=model, choices=[choice]))
        if out.finished:
            finals[i] = out
    if req.stream_options and req.stream_options.include_usage and all(finals):
        yield _data(P.CompletionResponse(id=rid, model=model, choices=[], usage=_usage(finals)))
    yield "data: [DONE]\n\n"


async def _chat_chunks(rid, model, req: P.ChatCompletionRequest, stream, choice: Any = "none",
                       parser: Any = None) -> AsyncIterator[str]:
    """Content deltas as text arrives. With tools: a named function streams its arguments as tool-call
    deltas; ``auto`` streams the text a call cannot begin in and sends the calls, whole, when the answer
    ends; ``required`` sends its calls at the end."""
    yield _data(P.ChatCompletionChunk(id=rid, model=model, choices=[
        P.ChatStreamChoice(index=j, delta=P.DeltaMessage(role="assistant", content="")) for j in range(req.n)]))
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    call_ids: dict[int, str] = {}
    final = None
    async for _, out in _merge([stream]):
        for c in out.outputs:
            if c.index in done:
                continue
            start = sent_text.get(c.index, 0)
            if choice in ("none", None) or named:
                upto = len(c.text)
            elif choice == "auto" and not c.finished():
                upto = max(start, parser.streamable(c.text))
            else:
                upto = start  # held back until the end
            delta = c.text[start:upto]
            if not delta and not c.finished():
                continue
            lp = _chat_logprobs(c, req.top_logprobs or 0, sent_tokens.get(c.index, 0)) if req.logprobs else None
            sent_text[c.index], sent_tokens[c.index] = upto, len(c.token_ids)
            finish = c.finish_reason
            message = P.DeltaMessage(content=delta)
            if named:
                first = c.index not in call_ids
                call_ids.setdefault(c.index, f"chatcmpl-tool-{uuid.uuid4().hex}")
                message = P.DeltaMessage(tool_calls=[P.DeltaToolCall(
                    index=0, id=call_ids[c.index] if first else None, type="function" if first else None,
                    function={"name": named, "arguments": delta} if first else {"arguments": delta})])
            elif c.finished() and choice in ("auto", "required"):
                content, calls, finish = _tool_answer(c.text, c.finish_reason, choice, parser)
                if choice == "required":
                    rest = content or ""
                else:  # the content not yet sent: up to where the calls begin, or all of it
                    rest = c.text[start:parser.streamable(c.text)].rstrip() if calls else c.text[start:]
                message = P.DeltaMessage(content=rest or None, tool_calls=[P.DeltaToolCall(
                    index=i, id=x["id"], type="function", function=x["function"])
                    for i, x in enumerate(call.to_openai() for call in calls)] or None)
            if c.finished():
                done.add(c.index)
            yield _data(P.ChatCompletionChunk(id=rid, model=model, choices=[P.ChatStreamChoice(
                index=c.index, delta=message, logprobs=lp, finish_reason=finish if c.finished() else None,
                stop_reason=c.stop_reason)]))
        if out.finished:
            final = out
    if req.stream_options and req.stream_options.include_usage and final is not None:
        yield _data(P.ChatCompletionChunk(id=rid, model=model, choices=[], usage=_usage([final])))
    yield "data: [DONE]\n\n"
