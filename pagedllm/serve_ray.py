"""pagedllm as a Ray Serve application: engine replicas behind an OpenAI-compatible ingress, with Ray Serve's
autoscaling, placement, rolling updates and request routing.

    serve run pagedllm.serve_ray:app_builder serve_args='["MODEL", "--max-model-len", "4096"]'
    serve deploy deploy/ray-serve.yaml

Two deployments:

* **PagedLLMEngine**: each replica runs what `pagedllm serve` runs (the same flags, parsed by the same
  parser: :func:`pagedllm.entrypoints.cli.server_app`), in process, without a socket: the ingress hands it
  each HTTP request (method, path, headers, body) and it drives the server's FastAPI app through ASGI,
  returning the response as it comes (status and headers, then body chunks). So every endpoint, limit and
  error of the server holds unchanged. With ``--distributed-executor-backend ray`` and tensor or pipeline
  parallelism, the replica's workers go into the replica's own placement group (one bundle per rank after the
  replica's).
* **PagedLLMIngress**: a thin FastAPI app that forwards every request to an engine replica by a streaming
  handle call. A replica that dies before the answer started (its status and first chunk) costs a retry on
  another replica, never the request.

Requests are routed between replicas by :class:`PrefixAwareRouter` (Ray Serve's request-router interface):
requests whose prompts begin alike go to the same replica, so its prefix cache serves them, unless that
replica is busier than the least busy by ``balance_threshold`` requests. Autoscaling is Ray Serve's, on the
requests each replica has in flight, waiting ones included (``target_ongoing_requests``).
"""

import asyncio
import hashlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from pagedllm.entrypoints.router import prefix_key

logger = logging.getLogger("pagedllm")

REPLICA_HEADER = "x-pagedllm-replica"  # on every answer: the engine replica that gave it
ATTEMPTS_HEADER = "x-pagedllm-attempts"  # and how many replicas were tried (more than 1: one died first)
_FORWARDED_HEADERS = ("authorization", "content-type", "accept", "traceparent", "tracestate")


# -- one HTTP request through an ASGI app, in process --------------------------------------------------------
async def asgi_stream(
    app: Any, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes
) -> AsyncIterator[tuple]:
    """Run one request through ``app``: yields ``("start", status, headers)``, then ``("body", bytes)`` chunks.
    Closing the generator early is a client disconnect: the app sees ``http.disconnect`` (and aborts)."""
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": ("127.0.0.1", 0),
        "server": ("pagedllm", 0),
        "state": {},
    }
    task = asyncio.ensure_future(app(scope, receive, out.put))
    try:
        while True:
            get = asyncio.ensure_future(out.get())
            await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():  # the app returned: what it sent is already queued
                get.cancel()
                task.result()  # (raises what the app raised)
                if out.empty():
                    return
                msg = out.get_nowait()
            else:
                msg = get.result()
            if msg["type"] == "http.response.start":
                yield ("start", msg["status"], [(k.decode("latin-1"), v.decode("latin-1")) for k, v in msg["headers"]])
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield ("body", bytes(msg["body"]))
                if not msg.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, 30)
            except (asyncio.TimeoutError, Exception):
                task.cancel()


class _Lifespan:
    """The app's ASGI lifespan, run by hand (what uvicorn does around serving)."""

    def __init__(self, app: Any):
        self._in: asyncio.Queue = asyncio.Queue()
        self._out: asyncio.Queue = asyncio.Queue()
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self._task = asyncio.ensure_future(app(scope, self._in.get, self._out.put))

    async def _send(self, event: str) -> None:
        await self._in.put({"type": f"lifespan.{event}"})
        msg = await self._out.get()
        if msg["type"].endswith(".failed"):
            raise RuntimeError(f"the server's lifespan {event} failed: {msg.get('message')}")

    async def startup(self) -> None:
        await self._send("startup")

    async def shutdown(self) -> None:
        await self._send("shutdown")
        await self._task


# -- the engine replicas ---------------------------------------------------------------------------------------
class PagedLLMEngine:
    """One engine replica: `pagedllm serve ARGV`'s app, in process."""

    async def __init__(self, argv: list[str]):  # type: ignore[misc]  # (Ray actors may construct asynchronously)
        from pagedllm.entrypoints.cli import build_parser, server_app

        args = build_parser().parse_args(["serve", *argv])
        self.app, self.model = server_app(args)
        self.state = self.app.state.server
        self._lifespan = _Lifespan(self.app)
        await self._lifespan.startup()  # starts loading the engine on a thread of its own
        while self.state.llm is None and self.state.load_error is None:
            await asyncio.sleep(0.05)
        if self.state.load_error is not None:
            raise RuntimeError(f"the engine did not load: {self.state.load_error}") from self.state.load_error
        try:
            self.replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside a Serve replica (a test calling the class directly)
            self.replica = "local"

    async def __call__(
        self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes
    ) -> AsyncIterator[tuple]:
        async for item in asgi_stream(self.app, method, path, query, headers, body):
            if item[0] == "start":
                item = (*item[:2], [*item[2], (REPLICA_HEADER, self.replica)])
            yield item

    async def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine died is replaced."""
        llm = self.state.llm
        if llm is None or getattr(llm, "_dead", None) is not None:
            raise RuntimeError("the engine is not serving")

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router may read of this replica besides its queue length."""
        engine = getattr(self.state.llm, "engine", None)
        if engine is None:
            return {}
        s = engine.core.scheduler
        return {"running": len(s.running), "waiting": s.num_waiting_requests(), "kv_usage": s.kv.usage()}

    async def __del__(self) -> None:
        try:
            await self._lifespan.shutdown()
        except Exception:  # (the process is going anyway)
            pass


# -- routing ----------------------------------------------------------------------------------------------------
class PrefixAwareRouter(RequestRouter):
    """Requests whose prompts begin alike go to the same replica (rendezvous hashing of the prompt's first
    ``prefix_blocks`` blocks of ``block_chars`` characters, as ``pagedllm router`` does), unless it has
    ``balance_threshold`` more requests in flight than the least loaded replica; requests without a prompt
    (``/health``, ``/metrics``) go to the least loaded."""

    def initialize_state(  # type: ignore[override]  # (the base takes **kwargs: a router's own options)
        self, block_chars: int = 64, prefix_blocks: int = 4, balance_threshold: int = 4
    ) -> None:
        self.block_chars = block_chars
        self.prefix_blocks = prefix_blocks
        self.balance_threshold = balance_threshold

    def _key(self, pending: PendingRequest | None) -> str | None:
        if pending is None or len(pending.args) < 5 or not isinstance(pending.args[4], bytes):
            return None
        try:
            body = json.loads(pending.args[4])
        except (ValueError, RecursionError):
            return None
        if not isinstance(body, dict) or not ("prompt" in body or "messages" in body or "input" in body):
            return None
        if "input" in body and "prompt" not in body and "messages" not in body:  # the Responses API
            body = {"prompt": body["input"]}
        return prefix_key(body, self.block_chars, self.prefix_blocks)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        cache = self._replica_queue_len_cache

        def load(r: RunningReplica) -> int:
            return cache.get(r.replica_id) or 0

        by_load = sorted(candidate_replicas, key=load)
        key = self._key(pending_request)
        if key is None:
            return [[r] for r in by_load]
        ranked = sorted(
            candidate_replicas,
            key=lambda r: hashlib.blake2b(f"{r.replica_id.unique_id}\0{key}".encode(), digest_size=8).digest(),
            reverse=True,
        )
        if load(ranked[0]) - load(by_load[0]) > self.balance_threshold:
            return [[r] for r in by_load]
        return [[r] for r in ranked]


# -- the ingress --------------------------------------------------------------------------------------------------
def _ingress_class() -> type:
    api = FastAPI(title="pagedllm (Ray Serve)")

    @serve.ingress(api)
    class PagedLLMIngress:
        """Forwards every request to an engine replica; retries where a replica died before answering."""

        def __init__(self, engine: Any, max_body_bytes: int, max_attempts: int = 3):
            self.engine = engine
            self.max_body_bytes = max_body_bytes
            self.max_attempts = max_attempts

        @api.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
        async def forward(self, request: Request, path: str) -> Any:
            import ray

            chunks, size = [], 0
            async for chunk in request.stream():  # bounded before it is held (the server's own limit)
                size += len(chunk)
                if size > self.max_body_bytes:
                    return JSONResponse(
                        {"error": {"message": f"request body over {self.max_body_bytes} bytes", "type": "too_large"}},
                        status_code=413,
                    )
                chunks.append(chunk)
            body = b"".join(chunks)
            headers = [(k, v) for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS]
            last = ""
            for attempt in range(self.max_attempts):
                gen = self.engine.options(stream=True).remote(
                    request.method, "/" + path, request.url.query, headers, body
                )
                try:  # the answer's status and first chunk: until then a dead replica costs only a retry
                    start = await gen.__anext__()
                    first = b""
                    async for _, chunk in _bodies(gen):
                        first = chunk
                        break
                except StopAsyncIteration:
                    return Response(status_code=502)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:  # a dead replica
                    last = f"{type(e).__name__}: {e}"
                    logger.warning("engine replica failed before answering (attempt %d): %s", attempt + 1, last)
                    continue
                _, status, out_headers = start
                kept = {k: v for k, v in out_headers if k.lower() not in ("content-length", "transfer-encoding")}
                kept[ATTEMPTS_HEADER] = str(attempt + 1)
                if not kept.get("content-type", "").startswith("text/event-stream"):
                    rest = [c async for _, c in _bodies(gen)]
                    return Response(b"".join([first, *rest]), status_code=status, headers=kept)
                return StreamingResponse(_relay(first, gen), status_code=status, headers=kept)
            return JSONResponse(
                {"error": {"message": f"no engine replica answered: {last}", "type": "service_unavailable"}},
                status_code=503,
            )

    return PagedLLMIngress


async def _bodies(gen: Any) -> AsyncIterator[tuple[str, bytes]]:
    async for item in gen:
        if item[0] == "body":
            yield item


async def _relay(first: bytes, gen: Any) -> AsyncIterator[bytes]:
    try:
        if first:
            yield first
        async for _, chunk in _bodies(gen):
            yield chunk
    except Exception as e:  # the replica died mid-stream: the client already has part of it
        logger.warning("engine replica failed mid-stream: %s", e)
        err = {"error": {"message": f"the engine replica failed mid-stream: {e}", "type": "server_error"}}
        yield f"data: {json.dumps(err)}\n\n".encode()
    finally:  # (also when the client went away: the replica's request is cancelled, and the engine aborts it)
        gen.cancel()


# -- building the application ----------------------------------------------------------------------------------
def build_app(
    argv: list[str],
    *,
    num_replicas: int | None = None,
    autoscaling_config: dict | None = None,
    max_ongoing_requests: int = 64,
    router_kwargs: dict | None = None,
    replica_cpus: float = 1.0,
    replica_gpus: float = 0.0,
) -> Any:
    """The Ray Serve application for `pagedllm serve ARGV` (the same flags): pass it to ``serve.run``.

    ``num_replicas`` fixes the replica count; ``autoscaling_config`` (Ray Serve's: ``min_replicas``,
    ``max_replicas``, ``target_ongoing_requests``, ``upscale_delay_s``, ...) scales it instead.
    ``router_kwargs`` go to :class:`PrefixAwareRouter`. Each replica holds ``replica_cpus`` CPUs and
    ``replica_gpus`` GPUs; with ``--distributed-executor-backend ray``, one more bundle per tensor / pipeline rank
    instead (a CPU, and a GPU where ``replica_gpus`` is set), where the engine places its workers."""
    from ray.serve.config import RequestRouterConfig

    from pagedllm.entrypoints.cli import _checked_serve_config, build_parser

    args = build_parser().parse_args(["serve", *argv])
    config = _checked_serve_config(args)  # bad flags fail here, not in every replica
    pc = config.parallel_config
    if pc.data_parallel_size > 1:
        raise SystemExit("--data-parallel-size: Ray Serve runs the replicas; set num_replicas or autoscaling")
    if num_replicas is not None and autoscaling_config is not None:
        raise SystemExit("give num_replicas or autoscaling_config, not both")
    options: dict[str, Any] = {
        "name": "PagedLLMEngine",
        "max_ongoing_requests": max_ongoing_requests,
        "ray_actor_options": {"num_cpus": replica_cpus, "num_gpus": replica_gpus},
        "request_router_config": RequestRouterConfig(
            request_router_class=PrefixAwareRouter,  # type: ignore[arg-type]  # (a class or its import path)
            request_router_kwargs=router_kwargs or {},
        ),
        "health_check_period_s": 5,
    }
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    else:
        options["num_replicas"] = num_replicas or 1
    world = pc.tensor_parallel_size * pc.pipeline_parallel_size
    if world > 1 and pc.distributed_executor_backend == "ray":
        # the replica's bundle, then one per rank: its workers are placed in it (pagedllm.executor.ray_executor)
        rank = {"CPU": 1.0, "GPU": 1.0} if replica_gpus else {"CPU": 1.0}
        options["placement_group_bundles"] = [{"CPU": replica_cpus}] + [rank] * world
        options["placement_group_strategy"] = "PACK"
        del options["ray_actor_options"]
    deployment: Any = serve.deployment  # (its stubs type only the decorator-with-options form)
    engine = deployment(PagedLLMEngine).options(**options)
    # the ingress only forwards: it must not be what limits the app's concurrency (Serve's default is 5)
    ingress = deployment(_ingress_class()).options(
        name="PagedLLMIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000
    )
    return ingress.bind(engine.bind(list(argv)), args.max_request_body_bytes)


def app_builder(args: dict[str, Any]) -> Any:
    """``serve run pagedllm.serve_ray:app_builder KEY=VALUE ...`` and ``import_path`` in a Serve config file.

    Keys: ``serve_args`` (the `pagedllm serve` flags, a list or a JSON list string), ``num_replicas``,
    ``min_replicas`` / ``max_replicas`` / ``target_ongoing_requests`` (autoscaling), ``max_ongoing_requests``,
    ``replica_cpus``, ``balance_threshold``."""
    args = dict(args)
    argv = args.pop("serve_args", [])
    if isinstance(argv, str):
        argv = json.loads(argv) if argv.startswith("[") else argv.split()
    auto: dict[str, Any] = {
        k: args.pop(k) for k in ("min_replicas", "max_replicas", "target_ongoing_requests") if k in args
    }
    for k in ("upscale_delay_s", "downscale_delay_s"):
        if k in args:
            auto[k] = float(args.pop(k))
    num = args.pop("num_replicas", None)
    router = {"balance_threshold": int(args.pop("balance_threshold"))} if "balance_threshold" in args else None
    built = build_app(
        [str(a) for a in argv],
        num_replicas=int(num) if num is not None else None,
        autoscaling_config={k: float(v) if k.endswith(("_s", "_requests")) else int(v) for k, v in auto.items()}
        or None,
        max_ongoing_requests=int(args.pop("max_ongoing_requests", 64)),
        router_kwargs=router,
        replica_cpus=float(args.pop("replica_cpus", 1.0)),
        replica_gpus=float(args.pop("replica_gpus", 0.0)),
    )
    if args:
        raise SystemExit(f"pagedllm.serve_ray: unknown arguments {sorted(args)}")
    return built
