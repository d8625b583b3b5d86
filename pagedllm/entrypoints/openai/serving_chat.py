"""``POST /v1/chat/completions``: messages → chat template → token ids → AsyncLLM → JSON or SSE, with tool calls.

The route is a thin shell over :func:`start_chat`, :func:`chat_response` and :func:`chat_chunks`, which take
plain values (no FastAPI request), so other front ends (the Responses API) can reuse the chat path.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request

from pagedllm.engine.async_llm import RequestStream
from pagedllm.entrypoints.openai import protocol as P
from pagedllm.entrypoints.openai.common import (
    JSONBodyRoute,
    chat_logprobs,
    merge_streams,
    run_to_end,
    sse_event,
    sse_response,
    usage_info,
)
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.state import ServerState, ServerStateDep
from pagedllm.errors import InvalidParameterError
from pagedllm.outputs import RequestOutput

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/v1/chat/completions", response_model=None, responses=P.STREAMED)
async def chat(req: P.ChatCompletionRequest, raw: Request, state: ServerStateDep):
    rid, streams, choice, parser = await start_chat(state, req, state.trace_headers(raw))
    model = req.model or state.served_model_name
    if req.stream:
        return sse_response(
            chat_chunks(rid, model, req, streams[0], choice, parser, state.enable_prompt_tokens_details)
        )
    finals = await run_to_end(streams, raw)
    return chat_response(rid, model, req, finals, choice, parser, state.enable_prompt_tokens_details)


async def start_chat(
    state: ServerState,
    req: P.ChatCompletionRequest,
    trace_headers: dict[str, str] | None,
    request_id: str | None = None,
) -> tuple[str, list[RequestStream], Any, Any]:
    """Check the request, apply the chat template and submit it: (request id, its one stream, tool choice, and
    under ``auto`` the server's tool-call parser for the request's tools; else None)."""
    from pagedllm.entrypoints.openai.tool_calls import check_tool_schemas

    llm = state.generator()
    lora = state.check_model(req.model)
    if req.chat_template is not None and not state.trust_request_chat_template:
        # a Jinja template runs arbitrary loops and string arithmetic on the server
        raise APIError(
            400,
            "chat_template in a request needs the server flag --trust-request-chat-template",
            "invalid_request_error",
            "chat_template",
        )
    params = req.to_sampling_params()
    choice = req.resolved_tool_choice()
    if choice == "auto" and state.tool_parser is None:
        raise APIError(
            400,
            'tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
            '--tool-call-parser; or ask for "required" or a named function',
            "invalid_request_error",
            "tool_choice",
        )
    if req.tools:
        check_tool_schemas([t.model_dump() for t in req.tools])
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and choice != "none" else None
    mm = llm.engine.mm_processor
    ids, images = await llm.prepare(
        chat_prompt,
        llm.tokenizer,
        req.messages,
        req.chat_template,
        req.add_generation_prompt,
        req.chat_template_kwargs,
        tools,
        None if mm is None else mm.limits.get("image", 0),
        None if mm is None else mm.chat_template,
    )
    rid = request_id or P.random_id("chatcmpl")
    prompt: dict[str, Any] = {"prompt_token_ids": ids}
    if images:  # read and processed with the request, off the event loop
        prompt["multi_modal_data"] = {"image": images}
    try:
        streams = await llm.add_requests(
            [prompt],
            params,
            rid,
            req.priority,
            lora_request=lora,
            trace_headers=trace_headers,
            max_tokens_must_fit=True,
        )
    except InvalidParameterError as e:
        # the images, and the one token a chat prompt holds for each, came in the messages
        if images and (e.param or "").startswith(("multi_modal_data", "prompt_token_ids")):
            raise InvalidParameterError(str(e), "messages") from None
        raise
    if lora is not None:
        state.metrics.lora_requests.labels(state.served_model_name, lora.lora_name).inc()
    parser = state.tool_parser.for_tools(tools) if choice == "auto" and state.tool_parser and tools else None
    return rid, streams, choice, parser


def chat_response(
    rid: str,
    model: str,
    req: P.ChatCompletionRequest,
    finals: list[RequestOutput],
    choice: Any,
    parser: Any,
    usage_details: bool = False,
) -> P.ChatCompletionResponse:
    """The whole answer, from the request's final output."""
    choices = []
    for c in finals[0].outputs:
        content, calls, finish = tool_answer(c.text, c.finish_reason, choice, parser, req.parallel_tool_calls)
        message = P.ChatResponseMessage(content=content, tool_calls=[P.ToolCall(**x.to_openai()) for x in calls])
        choices.append(
            P.ChatChoice(
                index=c.index,
                message=message,
                finish_reason=finish,
                stop_reason=c.stop_reason,
                logprobs=chat_logprobs(c, req.top_logprobs or 0) if req.logprobs else None,
            )
        )
    return P.ChatCompletionResponse(
        id=rid,
        model=model,
        choices=choices,
        usage=usage_info(finals, usage_details),
        kv_transfer_params=finals[0].kv_transfer_params,
    )


def chat_prompt(
    tok: Any,
    messages: list[P.ChatMessage],
    template: str | None,
    add_generation_prompt: bool,
    kwargs: dict | None,
    tools: list[dict] | None = None,
    max_images: int | None = None,
    mm_template: Callable[[], str | None] | None = None,
) -> tuple[list[int], list[str]]:
    """The conversation's prompt token ids, with one image placeholder where each ``image_url`` part was, and
    those parts' URLs in order. ``max_images``: None for a text-only model (an image part is refused), else
    the most a prompt may carry; ``mm_template``: the checkpoint's processor's chat template, used where the
    tokenizer has none."""
    if template is None and getattr(tok, "chat_template", None) is None and mm_template is not None:
        template = mm_template()
    if template is None and getattr(tok, "chat_template", None) is None:
        raise APIError(
            400, "this model has no chat template; pass `chat_template`", "invalid_request_error", "chat_template"
        )
    conv = []
    images: list[str] = []
    for m in messages:
        content = m.content
        if isinstance(content, list):  # OpenAI content parts: text, and images for a vision-language model
            parts: list[dict[str, Any]] = []
            for part in content:
                kind = part.get("type")
                if kind == "text":
                    parts.append({"type": "text", "text": str(part.get("text", ""))})
                elif kind == "image_url" and max_images is not None:
                    images.append(_image_url(part, len(images), max_images))
                    parts.append({"type": "image"})
                else:
                    also = (
                        " and 'image_url'"
                        if max_images is not None
                        else " here (images go to a vision-language model's chat completions)"
                    )
                    raise APIError(
                        400,
                        f"unsupported content part type {kind!r}; only 'text'{also}",
                        "invalid_request_error",
                        "messages",
                    )
            has_image = any(p["type"] == "image" for p in parts)
            content = parts if has_image else "".join(p["text"] for p in parts)
        conv.append({**m.model_dump(exclude_none=True), "content": content or ""})
    if images and template is None and mm_template is not None:  # the processor's knows image parts
        template = mm_template() or None
    try:
        text = tok.apply_chat_template(
            conv,
            chat_template=template,
            tokenize=False,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **(kwargs or {}),
        )
    except Exception as e:  # a template error is the request's fault (bad roles, bad template)
        raise APIError(400, f"chat template failed: {e}", "invalid_request_error", "messages") from e
    return tok.encode(text, add_special_tokens=False), images


def _image_url(part: dict[str, Any], index: int, max_images: int) -> str:
    if index >= max_images:
        raise APIError(
            400,
            f"the messages hold more than {max_images} images (limit_mm_per_prompt)",
            "invalid_request_error",
            "messages",
        )
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str):
        raise APIError(400, "an image_url part needs image_url.url, a string", "invalid_request_error", "messages")
    return url


def tool_answer(
    text: str, finish_reason: str | None, choice: Any, parser: Any, parallel: bool | None = True
) -> tuple[str | None, list, Any]:
    """(content, tool calls, finish_reason) of a finished answer under ``choice``; with ``parallel`` False
    (``parallel_tool_calls: false``), its first call only."""
    from pagedllm.entrypoints.openai.tool_calls import parse_forced

    if choice == "none":
        return text, [], finish_reason
    if choice == "auto":
        content, calls = parser.extract(text)
    else:
        calls = parse_forced(text, choice)
        content = None if calls else text or None  # cut short (length): the partial answer, as text
    if parallel is False:
        calls = calls[:1]
    named = isinstance(choice, dict)  # OpenAI answers a forced function with finish_reason "stop"
    return content, calls, ("tool_calls" if calls and not named and finish_reason == "stop" else finish_reason)


def stream_upto(text: str, sent: int, finished: bool, choice: Any, parser: Any) -> int:
    """How much of an answer's text may be streamed now, ``sent`` characters of it being out already: all of
    it (no tools, or a named function, whose arguments it is); under ``auto`` the text a call cannot begin in;
    under ``required`` nothing (the calls go out whole at the end, as does what ``auto`` held back)."""
    if choice in ("none", None) or isinstance(choice, dict):
        return len(text)
    if choice == "auto" and not finished:
        return max(sent, parser.streamable(text))
    return sent


def stream_end(
    text: str, sent: int, finish_reason: str | None, choice: Any, parser: Any, parallel: bool | None = True
) -> tuple[str, list, Any]:
    """At the end of an ``auto`` or ``required`` answer streamed up to ``sent``: (the content not yet sent,
    the calls, finish_reason)."""
    content, calls, finish = tool_answer(text, finish_reason, choice, parser, parallel)
    if choice == "required":
        rest = content or ""
    else:  # the content not yet sent: up to where the calls begin, or all of it
        rest = text[sent : parser.streamable(text)].rstrip() if calls else text[sent:]
    return rest, calls, finish


def live_calls(text: str, choice: Any, parser: Any) -> list[tuple[str, str]]:
    """The calls a partial answer shows being written, as (name, arguments' text so far): under ``auto`` those
    the parser streams (hermes' tagged calls, llama3_json's), under ``required`` each array item; else none."""
    from pagedllm.entrypoints.openai.tool_calls import required_stream_calls

    if choice == "auto":
        return parser.stream_calls(text)
    if choice == "required":
        return required_stream_calls(text)
    return []


class LiveCalls:
    """:func:`live_calls` for one answer as it grows. Each scan reads the whole answer, so scanning at every step
    would cost the square of a long answer's length on the event loop; past ``FREE`` characters the answer is
    scanned again only once it has grown by a ``1/GROWTH`` part since the last scan, which costs a constant times its
    length in all, and a long call's arguments still arrive in pieces (at least ``GROWTH`` of them)."""

    FREE = 4096
    GROWTH = 16

    def __init__(self, choice: Any, parser: Any):
        self.choice, self.parser = choice, parser
        self.scanned = -1  # the answer's length at the last scan
        self.calls: list[tuple[str, str]] = []
        self.work = 0  # characters read by the scans so far

    def __call__(self, text: str) -> list[tuple[str, str]]:
        if len(text) > self.FREE and (len(text) - self.scanned) * self.GROWTH < len(text):
            return self.calls
        self.scanned, self.work = len(text), self.work + len(text)
        self.calls = live_calls(text, self.choice, self.parser)
        return self.calls


def call_pieces(
    calls: list[tuple[str, str]], sent: list[tuple[str, str]], parallel: bool | None = True
) -> list[P.DeltaToolCall]:
    """Tool-call deltas that bring a client from what ``sent`` records (per call: its id and the arguments
    that went out) to ``calls`` (name, arguments so far): a new call's id, type and name once, then the
    arguments' new text. ``sent`` is updated. With ``parallel`` False, the first call only. Text already
    sent cannot be taken back: arguments that no longer begin with it (a tagged call whose JSON turned out
    malformed) get nothing more."""
    out = []
    for i, (name, args) in enumerate(calls[:1] if parallel is False else calls):
        if i == len(sent):
            sent.append((f"chatcmpl-tool-{uuid.uuid4().hex}", args))
            function = {"name": name, "arguments": args}
            out.append(P.DeltaToolCall(index=i, id=sent[i][0], type="function", function=function))
        elif len(args) > len(sent[i][1]) and args.startswith(sent[i][1]):
            out.append(P.DeltaToolCall(index=i, function={"arguments": args[len(sent[i][1]) :]}))
            sent[i] = (sent[i][0], args)
    return out


async def chat_chunks(
    rid,
    model,
    req: P.ChatCompletionRequest,
    stream,
    choice: Any = "none",
    parser: Any = None,
    usage_details: bool = False,
) -> AsyncIterator[str]:
    """Content deltas as text arrives. With tools: a named function streams its arguments as tool-call
    deltas; ``auto`` streams the text a call cannot begin in, and each call the parser sees being written
    (hermes' tagged and untagged calls, llama3_json's) as it comes: its id and name once, then its arguments in
    pieces, as ``required`` streams each call of its array; a call the parser shows only once it is whole (its
    arguments written as a JSON string) goes out when the answer ends."""
    yield sse_event(
        P.ChatCompletionChunk(
            id=rid,
            model=model,
            choices=[
                P.ChatStreamChoice(index=j, delta=P.DeltaMessage(role="assistant", content="")) for j in range(req.n)
            ],
        )
    )
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    call_ids: dict[int, str] = {}
    streamed_calls: dict[int, list[tuple[str, str]]] = {}  # per choice: each call's id and arguments sent
    scans: dict[int, LiveCalls] = {}  # per choice: the calls it shows being written
    final = None
    async for _, out in merge_streams([stream]):
        for c in out.outputs:
            if c.index in done:
                continue
            start = sent_text.get(c.index, 0)
            upto = stream_upto(c.text, start, c.finished(), choice, parser)
            delta = c.text[start:upto]
            sent_calls = streamed_calls.setdefault(c.index, [])
            call_deltas = (
                call_pieces(
                    scans.setdefault(c.index, LiveCalls(choice, parser))(c.text), sent_calls, req.parallel_tool_calls
                )
                if not c.finished()
                else []
            )
            if not delta and not call_deltas and not c.finished():
                continue
            lp = chat_logprobs(c, req.top_logprobs or 0, sent_tokens.get(c.index, 0)) if req.logprobs else None
            sent_text[c.index], sent_tokens[c.index] = upto, len(c.token_ids)
            finish = c.finish_reason
            message = P.DeltaMessage(content=delta)
            if named:
                first = c.index not in call_ids
                call_ids.setdefault(c.index, f"chatcmpl-tool-{uuid.uuid4().hex}")
                message = P.DeltaMessage(
                    tool_calls=[
                        P.DeltaToolCall(
                            index=0,
                            id=call_ids[c.index] if first else None,
                            type="function" if first else None,
                            function={"name": named, "arguments": delta} if first else {"arguments": delta},
                        )
                    ]
                )
            elif call_deltas:
                message = P.DeltaMessage(content=delta or None, tool_calls=call_deltas)
            elif c.finished() and choice in ("auto", "required"):
                rest, calls, finish = stream_end(
                    c.text, start, c.finish_reason, choice, parser, req.parallel_tool_calls
                )
                message = P.DeltaMessage(
                    content=rest or None,
                    tool_calls=call_pieces([(x.name, x.arguments) for x in calls], sent_calls, True) or None,
                )
            if c.finished():
                done.add(c.index)
            yield sse_event(
                P.ChatCompletionChunk(
                    id=rid,
                    model=model,
                    choices=[
                        P.ChatStreamChoice(
                            index=c.index,
                            delta=message,
                            logprobs=lp,
                            finish_reason=finish if c.finished() else None,
                            stop_reason=c.stop_reason,
                        )
                    ],
                )
            )
        if out.finished:
            final = out
    if req.stream_options and req.stream_options.include_usage and final is not None:
        yield sse_event(
            P.ChatCompletionChunk(id=rid, model=model, choices=[], usage=usage_info([final], usage_details))
        )
    yield "data: [DONE]\n\n"
