"""Probes and model info: /health, /metrics, /version, /v1/models, /tokenize, /detokenize; and the LoRA
load / unload endpoints (``lora_router``, included only with --allow-runtime-lora-updating)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from pagedllm import __version__
from pagedllm.entrypoints.openai import protocol as P
from pagedllm.entrypoints.openai.common import JSONBodyRoute
from pagedllm.entrypoints.openai.errors import APIError, error_response
from pagedllm.entrypoints.openai.serving_chat import chat_prompt
from pagedllm.entrypoints.openai.state import ServerStateDep
from pagedllm.entrypoints.openai.tool_calls import MAX_TOOLS, check_tool_schemas

router = APIRouter(route_class=JSONBodyRoute)
lora_router = APIRouter(route_class=JSONBodyRoute)


@router.get("/health", response_model=P.HealthResponse)
async def health(state: ServerStateDep):
    llm = state.llm
    if llm is None:
        if state.load_error is not None:
            return error_response(503, f"the model failed to load: {state.load_error}", "engine_dead")
        return error_response(503, "the model is still loading", "model_loading", headers={"Retry-After": "5"})
    if llm.dead is not None:
        return error_response(503, f"the engine can serve no more: {llm.dead}", "engine_dead")
    if llm.restarting:
        return error_response(
            503, "the engine is restarting after a fault", "engine_restarting", headers={"Retry-After": "1"}
        )
    return P.HealthResponse()


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(state: ServerStateDep):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version():
    return {"version": __version__}


@router.get("/v1/models", response_model=P.ModelList)
async def models(state: ServerStateDep):
    # 503 until the engine serves, as /health: a client that polls the list must not start sending too early
    max_len = state.engine().engine.max_model_len
    cards = [P.ModelCard(id=state.served_model_name, max_model_len=max_len)]
    cards += [
        P.ModelCard(id=name, root=req.lora_path, parent=state.served_model_name, max_model_len=max_len)
        for name, req in state.loras.items()
    ]
    return P.ModelList(data=cards)


@router.post("/tokenize", response_model=P.TokenizeResponse)
async def tokenize(req: P.TokenizeRequest, state: ServerStateDep):
    llm = state.engine()
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of `prompt` or `messages`", "invalid_request_error", "prompt")
    for name in ("tools", "chat_template_kwargs"):
        if getattr(req, name) is not None and req.messages is None:
            raise APIError(400, f"`{name}` applies to `messages`", "invalid_request_error", name)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"at most {MAX_TOOLS} tools, got {len(tools)}", "invalid_request_error", "tools")
    check_tool_schemas(tools)
    tok = llm.tokenizer
    if req.messages is not None:
        ids, _ = await llm.prepare(  # text parts only: an image part is refused (images are not tokenized here)
            chat_prompt, tok, req.messages, None, req.add_generation_prompt, req.chat_template_kwargs, tools or None
        )
    else:
        ids = await llm.prepare(lambda: tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    return P.TokenizeResponse(count=len(ids), max_model_len=llm.engine.max_model_len, tokens=ids)


@router.post("/detokenize", response_model=P.DetokenizeResponse)
async def detokenize(req: P.DetokenizeRequest, state: ServerStateDep):
    llm = state.engine()
    state.check_model(req.model)
    vocab = llm.engine.hf_config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", "invalid_request_error", "tokens")
    return P.DetokenizeResponse(prompt=await llm.prepare(llm.tokenizer.decode, req.tokens))


@lora_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(req: P.LoadLoRAAdapterRequest, state: ServerStateDep):
    llm = state.generator()
    if llm.engine.lora_cache is None:
        raise APIError(400, "this server was started without --enable-lora", "invalid_request_error", "lora_name")
    async with state.lora_lock:  # one at a time: the name check and the registration go together
        await llm.prepare(state.add_lora, req.lora_name, req.lora_path)  # reads the files off the loop
    return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")


@lora_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(req: P.UnloadLoRAAdapterRequest, state: ServerStateDep):
    lora = state.loras.pop(req.lora_name, None)
    if lora is None:
        raise APIError(404, f"no LoRA adapter named `{req.lora_name}` is loaded", "NotFoundError", "lora_name")
    # requests already running with it finish with it; it leaves the memory cache now
    lora_cache = state.generator().engine.lora_cache
    assert lora_cache is not None  # an adapter was loaded: LoRA is enabled
    lora_cache.remove(lora.lora_int_id)
    return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")
