"""What the route modules share: :class:`ServerState`, reached through the ``ServerStateDep`` dependency."""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.limits import RequestLimits
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.response_store import ResponseStore
from pagedllm.errors import InvalidParameterError
from pagedllm.lora import LoRARequest

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.dashboard import EngineStateHub


class ServerState:
    """What the endpoints share; `llm` is None until the engine has loaded."""

    def __init__(
        self,
        served_model_name: str,
        api_key: str | None,
        limits: RequestLimits,
        trust_request_chat_template: bool = False,
        tool_call_parser: str | None = None,
        keep_trace_context: bool = False,
        max_stored_responses: int = 1000,
        max_stored_response_bytes: int = 256 << 20,
        enable_prompt_tokens_details: bool = False,
    ):
        from pagedllm.entrypoints.openai.tool_calls import TOOL_PARSERS

        self.tool_parser = TOOL_PARSERS[tool_call_parser]() if tool_call_parser else None
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.open_endpoints: frozenset[str] = frozenset()  # paths that answer without api_key (set by build_app)
        self.limits = limits
        self.trust_request_chat_template = trust_request_chat_template
        self.enable_prompt_tokens_details = enable_prompt_tokens_details  # usage.prompt_tokens_details.cached_tokens
        self.keep_trace_context = keep_trace_context  # spans are exported: pass the client's trace context on
        self.llm: AsyncLLM | None = None
        self.metrics = ServerMetrics(served_model_name)
        self.load_error: BaseException | None = None
        self.loras: dict[str, LoRARequest] = {}  # adapter name -> request (the `model` field selects one)
        self.lora_lock = asyncio.Lock()
        self._lora_ids = itertools.count(1)
        # the Responses API's, for GET and previous_response_id; its size is exported
        self.responses = ResponseStore(max_stored_responses, max_stored_response_bytes)
        self.metrics.stored_responses_bytes.set_function(lambda: self.responses.bytes)
        self.hub: EngineStateHub | None = None  # the dashboards' snapshot stream, set by build_app
        # large JSON bodies are parsed here, one at a time: the C parser holds the GIL, so more threads would
        # parse no faster, and a fixed one keeps the server's thread count from growing with concurrency
        self.json_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-json")

    def add_lora(self, name: str, path: str) -> LoRARequest:
        """Register an adapter (checked and loaded by the engine first)."""
        if name == self.served_model_name or name in self.loras:
            raise InvalidParameterError(f"a model or adapter named {name!r} is already served", "lora_name")
        req = LoRARequest(name, next(self._lora_ids), path)
        assert self.llm is not None  # adapters are added through the loaded engine
        self.llm.engine.check_lora(req)
        self.loras[name] = req
        return req

    def engine(self) -> AsyncLLM:
        if self.llm is None:
            if self.load_error is not None:
                raise APIError(503, f"the model failed to load: {self.load_error}", "engine_dead")
            raise APIError(503, "the model is still loading", "model_loading", headers={"Retry-After": "5"})
        return self.llm

    def generator(self) -> AsyncLLM:
        llm = self.engine()
        if llm.engine.is_pooling:
            raise APIError(
                400,
                f"`{self.served_model_name}` is a pooling model: use /v1/embeddings, /score or /rerank",
                "invalid_request_error",
                "model",
            )
        return llm

    def pooler(self) -> AsyncLLM:
        llm = self.engine()
        if not llm.engine.is_pooling:
            raise APIError(
                400,
                f"`{self.served_model_name}` generates text; embeddings and scores need a pooling "
                "model (pagedllm serve MODEL --runner pooling)",
                "invalid_request_error",
                "model",
            )
        return llm

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model); 404 for an unknown name."""
        if name is None or name == self.served_model_name:
            return None
        if name in self.loras:
            return self.loras[name]
        served = ", ".join(f"`{n}`" for n in [self.served_model_name, *self.loras])
        raise APIError(404, f"the model `{name}` does not exist; this server serves {served}", "NotFoundError", "model")

    def trace_headers(self, raw: Request) -> dict[str, str] | None:
        """The client's W3C trace context (``traceparent``, ``tracestate``), kept only when spans are exported."""
        if not self.keep_trace_context:
            return None
        got = {k: v for k in ("traceparent", "tracestate") if (v := raw.headers.get(k)) and len(v) <= 512}
        return got or None


async def server_state(request: Request) -> ServerState:
    # async: FastAPI runs a plain-def dependency on a worker thread, a hop per request for nothing
    return request.app.state.server


ServerStateDep = Annotated[ServerState, Depends(server_state)]
