"""``POST /v1/completions``: prompts → SamplingParams → AsyncLLM → JSON or SSE."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from pagedllm.entrypoints.openai import protocol as P
from pagedllm.entrypoints.openai.common import (
    JSONBodyRoute,
    completion_logprobs,
    merge_streams,
    run_to_end,
    sse_event,
    sse_response,
    usage_info,
)
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.state import ServerStateDep
from pagedllm.outputs import RequestOutput

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/v1/completions", response_model=None, responses=P.STREAMED)
async def completions(req: P.CompletionRequest, raw: Request, state: ServerStateDep):
    llm = state.generator()
    lora = state.check_model(req.model)
    prompts = completion_prompts(req.prompt)
    if req.kv_transfer_params is not None and len(prompts) > 1:
        raise APIError(400, "kv_transfer_params takes one prompt", "invalid_request_error", "kv_transfer_params")
    params = req.to_sampling_params()
    rid = P.random_id("cmpl")
    streams = await llm.add_requests(
        prompts,
        params,
        rid,
        req.priority,
        lora_request=lora,
        trace_headers=state.trace_headers(raw),
        max_tokens_must_fit=True,
    )
    if lora is not None:
        state.metrics.lora_requests.labels(state.served_model_name, lora.lora_name).inc(len(prompts))
    tok = llm.tokenizer
    if req.stream:
        model = req.model or state.served_model_name
        return sse_response(completion_chunks(rid, model, req, streams, tok, state.enable_prompt_tokens_details))
    finals = await run_to_end(streams, raw)
    choices = []
    for i, out in enumerate(finals):
        prefix = (out.prompt if out.prompt is not None else tok.decode(out.prompt_token_ids)) if req.echo else ""
        for c in out.outputs:
            choices.append(
                P.CompletionChoice(
                    index=i * req.n + c.index,
                    text=prefix + c.text,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=completion_logprobs(c, len(prefix), req.logprobs) if req.logprobs is not None else None,
                )
            )
    return P.CompletionResponse(
        id=rid,
        model=req.model or state.served_model_name,
        choices=choices,
        usage=usage_info(finals, state.enable_prompt_tokens_details),
        kv_transfer_params=finals[0].kv_transfer_params,
    )


def completion_prompts(prompt: Any) -> list[Any]:
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


async def completion_chunks(
    rid, model, req: P.CompletionRequest, streams, tok, usage_details: bool = False
) -> AsyncIterator[str]:
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge_streams(streams):
        for c in out.outputs:
            idx = i * req.n + c.index
            if idx in done:
                continue
            first_chunk = idx not in sent_text
            prefix = ""
            if req.echo and first_chunk:
                prefix = out.prompt if out.prompt is not None else tok.decode(out.prompt_token_ids)
            delta = c.text[sent_text.get(idx, 0) :]
            if not delta and not prefix and not c.finished():
                continue
            lp = (
                completion_logprobs(c, sent_text.get(idx, 0), req.logprobs, sent_tokens.get(idx, 0))
                if req.logprobs is not None
                else None
            )
            sent_text[idx], sent_tokens[idx] = len(c.text), len(c.token_ids)
            if c.finished():
                done.add(idx)
            choice = P.CompletionChoice(
                index=idx, text=prefix + delta, logprobs=lp, finish_reason=c.finish_reason, stop_reason=c.stop_reason
            )
            yield sse_event(P.CompletionResponse(id=rid, model=model, choices=[choice]))
        if out.finished:
            finals[i] = out
    completed = [f for f in finals if f is not None]
    if req.stream_options and req.stream_options.include_usage and len(completed) == len(finals):
        yield sse_event(
            P.CompletionResponse(id=rid, model=model, choices=[], usage=usage_info(completed, usage_details))
        )
    yield "data: [DONE]\n\n"
