"""``pagedllm router``: one OpenAI-compatible front door for many pagedllm servers.

It forwards ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/responses`` (streamed or
not) to one backend chosen by the routing policy:

* ``prefix-aware``: requests whose prompts begin alike go to the same backend, so its
  prefix cache serves them. The key is the prompt's first ``prefix_blocks`` blocks of
  ``block_chars`` characters (chat messages are rendered to one string first); a
  rendezvous hash of the key picks among the healthy backends, so a backend that
  leaves moves only its own keys. A backend more loaded than the least loaded by
  ``balance_threshold`` requests loses the request to the least loaded one.
* ``least-load``: the fewest requests running + waiting (from each backend's own
  ``/metrics``, plus what this router sent since), ties broken by KV cache usage.
* ``round-robin``.

A background task polls every backend's ``/health`` and ``/metrics``. A request
whose backend fails before the client got anything (refused, reset, gone mid-request,
or a non-streamed answer cut off between its headers and its body) is retried on
another one: generating has no side effects. A stream cut off after it began ends
with an error event, since the client already has part of it. ``/metrics`` exports
the router's own counters; ``/health`` answers 200 while any backend is healthy.
``pagedllm serve --data-parallel-size N`` runs this in front of N engine processes.

A stored response lives in the backend that answered it, so the router remembers which one that was (the
``id`` of each ``/v1/responses`` answer, streamed or not; the most recent ``max_response_ids``): a request that
continues it (``previous_response_id``), and ``GET`` / ``DELETE /v1/responses/{id}``, go there. An id it does
not know (the router restarted) is looked for on each healthy backend in turn.

``pagedllm disagg-proxy --prefill URL --decode URL`` is the same router with prefill
engines in front: each request first goes to a prefill engine as a one-token request
(vLLM's protocol: with ``kv_transfer_params: {"do_remote_decode": true}``), then to a
decode engine, which streams the answer. The prompt's KV blocks reach it through the KV
tier the engines share (DiskConnector), or over the network (MooncakeConnector: the
prefill engine's answer says where its blocks wait, and the decode request carries that).
"""

import asyncio
import hashlib
import hmac
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.graceful_server import (
    SERVER_KEEP_ALIVE_S,
    ConnectionBounds,
    client_limits,
    graceful_server_class,
)

logger = logging.getLogger("pagedllm")

ROUTING_POLICIES = ("prefix-aware", "least-load", "round-robin")
_RESPONSES = "/v1/responses"
_FORWARDED = ("/v1/completions", "/v1/chat/completions", _RESPONSES)


@dataclass(slots=True)
class Backend:
    url: str
    healthy: bool = False
    running: float = 0.0  # from its /metrics at the last poll
    waiting: float = 0.0
    kv_usage: float = 0.0
    sent_since_poll: int = 0  # requests this router sent it since that poll (the poll lags)
    done_since_poll: int = 0  # requests of this router's that ended since that poll
    in_flight: int = 0  # requests this router is forwarding to it now
    last_error: str | None = None

    @property
    def load(self) -> float:
        # what the poll saw, plus what was sent since, minus what ended since: short requests sent and
        # finished between two polls must not count, or a burst looks like an overload and spills
        return max(self.running + self.waiting + self.sent_since_poll - self.done_since_poll, self.in_flight)

    def sent(self) -> None:
        self.sent_since_poll += 1
        self.in_flight += 1

    def ended(self) -> None:
        self.done_since_poll += 1
        self.in_flight -= 1


@dataclass(slots=True)
class RouterConfig:
    backends: list[str]
    routing: str = "prefix-aware"
    health_check_interval: float = 1.0
    block_chars: int = 64
    prefix_blocks: int = 4
    balance_threshold: int = 8
    max_attempts: int = 3
    request_timeout: float = 600.0
    max_response_ids: int = 100_000  # stored responses whose backend the router remembers (least recent go)
    # disaggregated serving (`pagedllm disagg-proxy`): prefill engines that compute each prompt first, their KV
    # reaching the backends (the decode engines) through a shared KV tier
    prefill: list[str] = field(default_factory=list)


def prefix_key(body: dict[str, Any], block_chars: int, prefix_blocks: int) -> str:
    """The text routing looks at: the first ``prefix_blocks`` whole blocks of the prompt (all of it if shorter)."""
    if "messages" in body:
        text = json.dumps(body.get("messages"), sort_keys=True, ensure_ascii=False)
    else:
        prompt = body.get("prompt", "")
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    whole = min(len(text) // block_chars, prefix_blocks) * block_chars
    return text[: whole or len(text)]


def rendezvous(key: str, backends: list[Backend]) -> Backend:
    """Highest-random-weight hashing: each key's ranking of backends is fixed, so removing one moves
    only the keys it held."""

    def weight(b: Backend) -> bytes:
        return hashlib.blake2b(f"{b.url}\0{key}".encode(), digest_size=8).digest()

    return max(backends, key=weight)


class Router:
    def __init__(self, config: RouterConfig):
        if config.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {list(ROUTING_POLICIES)}, got {config.routing!r}")
        if not config.backends:
            raise ValueError("the router needs at least one --backend")
        self.config = config
        self.backends = [Backend(url.rstrip("/")) for url in config.backends]
        self._rr = 0
        self._response_at: OrderedDict[str, str] = OrderedDict()  # response id -> the backend holding it
        self._client: Any = None
        self._poller: asyncio.Task | None = None
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.m_requests = Counter(
            "pagedllm_router:requests",
            "Requests forwarded, by backend and outcome.",
            ["backend", "outcome"],
            registry=self.registry,
        )
        self.m_retries = Counter(
            "pagedllm_router:retries",
            "Requests retried on another backend because theirs "
            "could not be reached or cut its answer off before the body.",
            registry=self.registry,
        )
        self.m_healthy = Gauge(
            "pagedllm_router:backend_healthy",
            "1 while the backend passes its health check.",
            ["backend"],
            registry=self.registry,
        )
        self.m_load = Gauge(
            "pagedllm_router:backend_load",
            "Requests running + waiting on the backend.",
            ["backend"],
            registry=self.registry,
        )
        self.m_prefills = Counter(
            "pagedllm_router:prefills",
            "Disaggregated serving: prompts sent to a prefill "
            "engine first, by outcome (a failed one is computed by the decode engine).",
            ["backend", "outcome"],
            registry=self.registry,
        )
        self.m_prefill_seconds = Counter(
            "pagedllm_router:prefill_seconds",
            "Disaggregated serving: time spent waiting for prefill engines.",
            registry=self.registry,
        )

    # -- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        import httpx

        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.config.request_timeout, connect=5.0), limits=client_limits(1000, 100)
        )
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self._client is not None:
            await self._client.aclose()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval)
            await self.poll_once()

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(b) for b in self.backends))

    async def _poll(self, b: Backend) -> None:
        try:
            health = await self._client.get(f"{b.url}/health", timeout=5.0)
            ok = health.status_code == 200
            if ok:
                metrics = (await self._client.get(f"{b.url}/metrics", timeout=5.0)).text
                b.running = _metric(metrics, "pagedllm:num_requests_running")
                b.waiting = _metric(metrics, "pagedllm:num_requests_waiting")
                b.kv_usage = _metric(metrics, "pagedllm:kv_cache_usage_perc")
                b.sent_since_poll = b.done_since_poll = 0
            b.last_error = None if ok else f"/health answered {health.status_code}"
        except Exception as e:
            ok, b.last_error = False, f"{type(e).__name__}: {e}"
        if b.healthy != ok:
            logger.warning(
                "backend %s is %s%s",
                b.url,
                "healthy" if ok else "unhealthy",
                f" ({b.last_error})" if b.last_error else "",
            )
        b.healthy = ok
        self.m_healthy.labels(b.url).set(1 if ok else 0)
        self.m_load.labels(b.url).set(b.running + b.waiting)

    # -- routing --------------------------------------------------------------------
    def remember(self, response_id: Any, url: str) -> None:
        if isinstance(response_id, str):
            self._response_at[response_id] = url
            self._response_at.move_to_end(response_id)
            while len(self._response_at) > self.config.max_response_ids:
                self._response_at.popitem(last=False)

    def holder(self, response_id: Any) -> Backend | None:
        """The backend that answered this stored response, where the router knows it."""
        url = self._response_at.get(response_id) if isinstance(response_id, str) else None
        return next((b for b in self.backends if b.url == url), None)

    def choose(self, body: dict[str, Any], exclude: set[str], path: str = "") -> Backend | None:
        if path == _RESPONSES and (held := self.holder(body.get("previous_response_id"))) is not None:
            return None if held.url in exclude else held  # only it holds the conversation
        live = [b for b in self.backends if b.healthy and b.url not in exclude]
        if not live:
            return None
        policy = self.config.routing
        if policy == "round-robin":
            self._rr += 1
            return live[self._rr % len(live)]
        least = min(live, key=lambda b: (b.load, b.kv_usage))
        if policy == "least-load":
            return least
        pick = rendezvous(prefix_key(body, self.config.block_chars, self.config.prefix_blocks), live)
        return least if pick.load - least.load > self.config.balance_threshold else pick

    async def prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict | None:
        """Disaggregated serving: have a prefill engine compute the prompt (one token) so its KV blocks reach the
        decode engine: through the shared tier (DiskConnector), or by the decode engine reading them where the
        prefill engine holds them (MooncakeConnector: the ``kv_transfer_params`` it answers, returned here for
        the decode request). Any failure only costs the decode engine the prompt's computation."""
        import time

        urls = self.config.prefill
        self._rr += 1
        url = urls[self._rr % len(urls)]
        t0 = time.monotonic()
        params = None
        try:
            resp = await self._client.post(f"{url}{path}", json=prefill_body(body), headers=headers)
            outcome = str(resp.status_code)
            if resp.status_code == 200:
                params = _json_field(resp.content, "kv_transfer_params")
        except Exception as e:
            outcome = "unreachable"
            logger.warning("prefill engine %s failed (%s); the decode engine computes the prompt", url, e)
        self.m_prefills.labels(url, outcome).inc()
        self.m_prefill_seconds.inc(time.monotonic() - t0)
        return params if isinstance(params, dict) else None

    async def forward(self, path: str, body: dict[str, Any], raw: bytes, headers: dict[str, str]) -> Any:
        """Send the request to a backend (retrying where it never started); the response to return."""
        import httpx
        from fastapi.responses import JSONResponse, Response, StreamingResponse

        if self.config.prefill and path != _RESPONSES:  # (a response's prompt is the decode engine's to compute)
            params = await self.prefill(path, body, headers)
            if params is not None or "kv_transfer_params" in body:  # only a prefill engine's, never a client's
                clean = {k: v for k, v in body.items() if k != "kv_transfer_params"}
                raw = json.dumps(clean if params is None else {**clean, "kv_transfer_params": params}).encode()

        tried: set[str] = set()
        last = "no healthy backend"
        for attempt in range(self.config.max_attempts):
            b = self.choose(body, tried, path)
            if b is None:
                break
            tried.add(b.url)
            if attempt:
                self.m_retries.inc()
            b.sent()
            try:
                req = self._client.build_request("POST", f"{b.url}{path}", content=raw, headers=headers)
                resp = await self._client.send(req, stream=True)
            except httpx.TransportError as e:  # before any answer: generating has no side effects, retry
                b.ended()
                b.healthy = False  # until the next poll says otherwise
                last = f"{b.url}: {type(e).__name__}: {e}"
                self.m_requests.labels(b.url, "unreachable").inc()
                logger.warning("backend %s unreachable, retrying elsewhere: %s", b.url, e)
                continue
            self.m_requests.labels(b.url, str(resp.status_code)).inc()
            out_headers = {"x-pagedllm-backend": b.url}
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                return StreamingResponse(
                    self._relay(resp, b, learn=path == _RESPONSES),
                    status_code=resp.status_code,
                    media_type="text/event-stream",
                    headers=out_headers,
                )
            try:
                content = await resp.aread()
            except httpx.HTTPError as e:  # died between its headers and its body: the client has
                self.m_requests.labels(b.url, "broken").inc()  # nothing yet, so retry elsewhere
                b.healthy = False
                last = f"{b.url}: failed mid-answer: {type(e).__name__}: {e}"
                logger.warning("backend %s failed mid-answer, retrying elsewhere: %s", b.url, e)
                continue
            finally:
                b.ended()
                await resp.aclose()
            if path == _RESPONSES and resp.status_code == 200:
                self.remember(_json_field(content, "id"), b.url)
            return Response(
                content, status_code=resp.status_code, headers=out_headers, media_type=resp.headers.get("content-type")
            )
        return JSONResponse(
            {
                "error": {
                    "message": f"no backend could take the request ({last})",
                    "type": "ServiceUnavailable",
                    "code": 503,
                }
            },
            status_code=503,
        )

    async def stored(self, method: str, path: str, response_id: str, query: str, headers: dict[str, str]) -> Any:
        """``GET`` / ``DELETE /v1/responses/{id}``: from the backend that holds it, else from the first healthy
        one that knows it (404 when none does)."""
        from fastapi.responses import JSONResponse, Response

        held = self.holder(response_id)
        candidates = [held] if held is not None else [b for b in self.backends if b.healthy]
        unreachable = []
        for b in candidates:
            try:
                resp = await self._client.request(method, f"{b.url}{path}{query}", headers=headers)
            except Exception as e:
                logger.warning("backend %s unreachable for %s %s: %s", b.url, method, path, e)
                unreachable.append(b.url)
                continue
            if resp.status_code == 404 and held is None:
                continue
            if method == "DELETE" and resp.status_code == 200:
                self._response_at.pop(response_id, None)
            elif resp.status_code == 200:
                self.remember(response_id, b.url)
            out = {"x-pagedllm-backend": b.url}
            return Response(resp.content, resp.status_code, out, media_type=resp.headers.get("content-type"))
        if unreachable:  # it may be on a backend that did not answer
            message = f"the backend that may hold response '{response_id}' is unreachable: {', '.join(unreachable)}"
            return JSONResponse({"error": {"message": message, "type": "ServiceUnavailable", "code": 503}}, 503)
        error = {"message": f"Response with id '{response_id}' not found.", "type": "NotFoundError", "code": 404}
        return JSONResponse({"error": {**error, "param": "response_id"}}, status_code=404)

    async def _relay(self, resp: Any, b: Backend, learn: bool = False) -> AsyncIterator[bytes]:
        """A backend's stream, as it comes; with ``learn``, the response id its first event (``response.created``)
        names is remembered as that backend's."""
        import httpx

        head = b""
        try:
            async for chunk in resp.aiter_raw():
                if learn:
                    head += chunk
                    event, sep, _ = head.partition(b"\n\n")
                    if sep:
                        data = event.split(b"data: ", 1)[-1]
                        created = _json_field(data, "response")
                        self.remember(created.get("id") if isinstance(created, dict) else None, b.url)
                        learn, head = False, b""
                    elif len(head) > 1 << 20:  # no first event in a megabyte: not worth holding on to
                        learn, head = False, b""
                yield chunk
        except httpx.HTTPError as e:
            self.m_requests.labels(b.url, "broken").inc()
            err = {"error": {"message": f"backend {b.url} failed mid-stream: {e}", "type": "BadGateway", "code": 502}}
            yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            b.ended()
            await resp.aclose()


# what a prefill request drops: it returns one token nobody reads, so nothing about the answer matters
_NOT_FOR_PREFILL = (
    "stream",
    "stream_options",
    "n",
    "best_of",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "min_tokens",
    "max_completion_tokens",
    "stop",
    "stop_token_ids",
)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request a prefill engine gets: the same prompt (the same tokens, so the same block hashes), one
    greedy token."""
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    out.update(max_tokens=1, temperature=0, kv_transfer_params={"do_remote_decode": True})
    return out


def _json_field(raw: bytes, key: str) -> Any:
    """A field of a JSON object's text, or None where it is not one."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return value.get(key) if isinstance(value, dict) else None


def _metric(text: str, name: str) -> float:
    """The sum of a metric's samples in Prometheus text (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return total


def build_router_app(
    config: RouterConfig, api_key: str | None = None, max_body_bytes: int = 4 << 20, body_timeout: float = 30.0
) -> Any:
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    from pagedllm.entrypoints.openai.server import BodyLimit

    router = Router(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="pagedllm router", lifespan=lifespan)
    app.state.router = router
    # the servers' own body limit (413 beyond it) and deadline for each chunk of a body (408)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout=body_timeout)

    def unauthorized(request: Request) -> JSONResponse | None:
        supplied = request.headers.get("authorization", "").encode()
        if api_key and not hmac.compare_digest(supplied, f"Bearer {api_key}".encode()):
            return JSONResponse(
                {"error": {"message": "invalid or missing API key", "type": "AuthenticationError", "code": 401}},
                status_code=401,
            )
        return None

    async def proxy(request: Request, path: str) -> Any:
        if (denied := unauthorized(request)) is not None:
            return denied
        raw = await request.body()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
        except RecursionError:
            return JSONResponse(
                {"error": {"message": "the JSON body is nested too deeply", "type": "BadRequestError", "code": 400}},
                status_code=400,
            )
        except ValueError as e:
            return JSONResponse(
                {
                    "error": {
                        "message": f"the request body is not a JSON object: {e}",
                        "type": "BadRequestError",
                        "code": 400,
                    }
                },
                status_code=400,
            )
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        return await router.forward(path, body, raw, headers)

    for path in _FORWARDED:

        async def handler(request: Request, _path: str = path) -> Any:
            return await proxy(request, _path)

        app.post(path)(handler)

    async def stored(request: Request, response_id: str) -> Any:
        if (denied := unauthorized(request)) is not None:
            return denied
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        query = f"?{request.url.query}" if request.url.query else ""
        path = f"{_RESPONSES}/{response_id}"
        return await router.stored(request.method, path, response_id, query, headers)

    app.get(_RESPONSES + "/{response_id}")(stored)
    app.delete(_RESPONSES + "/{response_id}")(stored)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        if (denied := unauthorized(request)) is not None:
            return denied
        for b in router.backends:
            if b.healthy:
                resp = await router._client.get(
                    f"{b.url}/v1/models",
                    headers={k: v for k, v in request.headers.items() if k.lower() == "authorization"},
                )
                return Response(resp.content, status_code=resp.status_code, media_type="application/json")
        return JSONResponse({"error": {"message": "no healthy backend", "code": 503}}, status_code=503)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if any(b.healthy for b in router.backends) else 503)

    @app.get("/backends")
    async def backends(request: Request) -> Any:  # the backends' addresses and errors: behind the key
        if (denied := unauthorized(request)) is not None:
            return denied
        return [
            {
                "url": b.url,
                "healthy": b.healthy,
                "running": b.running,
                "waiting": b.waiting,
                "kv_cache_usage": b.kv_usage,
                "in_flight": b.in_flight,
                "last_error": b.last_error,
            }
            for b in router.backends
        ]

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def run_router(
    config: RouterConfig,
    host: str,
    port: int,
    api_key: str | None = None,
    log_level: str = "warning",
    max_body_bytes: int = 4 << 20,
    timeout_keep_alive: int = SERVER_KEEP_ALIVE_S,
    connections: ConnectionBounds | None = None,
) -> None:
    import uvicorn

    bounds = connections or ConnectionBounds()
    logger.info("routing (%s) over %d backends at http://%s:%d/v1", config.routing, len(config.backends), host, port)
    app = build_router_app(config, api_key, max_body_bytes, bounds.body_timeout)
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_keep_alive=timeout_keep_alive,
        **bounds.uvicorn_kwargs(),
    )
    graceful_server_class()(uv_config).run()
