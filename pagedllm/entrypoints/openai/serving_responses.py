"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``, over the chat path.

A request becomes a chat request (the conversation of the response it continues, then its input items as
messages, after its ``instructions`` as a system message) and runs through :func:`serving_chat.start_chat`: the
same checks, limits, admission, chat template, tool grammars and metrics as ``/v1/chat/completions``. The answer
becomes output items: a ``message`` with one ``output_text`` part, and / or ``function_call`` items.

Streamed, the events are OpenAI's, each with its ``sequence_number``::

    response.created, response.in_progress
    per item:  response.output_item.added
               message:        response.content_part.added, response.output_text.delta ...,
                               response.output_text.done, response.content_part.done
               function_call:  response.function_call_arguments.delta ..., response.function_call_arguments.done
               response.output_item.done
    response.completed   (response.incomplete when max_output_tokens cut the answer)

The text streams as the chat path streams it (all of it; under ``tool_choice: auto`` the text no call can begin
in, and each call the parser sees being written (hermes' tagged and untagged, llama3_json's) as an item of its own,
its arguments in pieces; a named function's arguments as they come;
``required``'s calls each as an item of its own, its arguments in pieces), and the last event carries
the response a non-streamed request gets. (Two exceptions. As in chat: under ``auto``, whitespace streamed before a
call began stays in the streamed message, where the non-streamed answer trims it. And a call streamed as it was
written (hermes' tagged and untagged, llama3_json's, required's), then cut short (``max_output_tokens``) or found
malformed (or, for llama3_json and untagged calls, followed by other text; for untagged ones, arguments that fail the
tool's schema), stays in the streamed response as an
incomplete ``function_call`` item, out of the stored conversation, where the non-streamed answer holds its text
in the message.)
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, TypeAdapter

from pagedllm.engine.async_llm import RequestStream
from pagedllm.entrypoints.openai import protocol as P
from pagedllm.entrypoints.openai.common import JSONBodyRoute, merge_streams, run_to_end, sse_response
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.response_store import StoredResponse
from pagedllm.entrypoints.openai.serving_chat import (
    LiveCalls,
    live_calls,
    start_chat,
    stream_end,
    stream_upto,
    tool_answer,
)
from pagedllm.entrypoints.openai.state import ServerState, ServerStateDep
from pagedllm.entrypoints.openai.tool_calls import ParsedCall
from pagedllm.errors import InvalidParameterError
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

router = APIRouter(route_class=JSONBodyRoute)

_ITEMS = TypeAdapter(list[P.ResponsesInputItem])
_Item = P.ResponsesOutputMessage | P.ResponsesFunctionCall  # an output item

# vLLM's sampling fields a responses request shares with a chat request, passed on as they are
_SHARED_FIELDS = (
    "model",
    "temperature",
    "top_p",
    "user",
    "parallel_tool_calls",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "ignore_eos",
    "logit_bias",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "priority",
    "structured_outputs",
)


@router.post("/v1/responses", response_model=None, responses=P.STREAMED)
async def create_response(req: P.ResponsesRequest, raw: Request, state: ServerStateDep):
    _check_supported(req)
    history: tuple[P.ChatMessage, ...] = ()
    if req.previous_response_id is not None:
        previous = state.responses.get(req.previous_response_id)
        if previous is None:
            raise APIError(
                400,
                f"Previous response with id '{req.previous_response_id}' not found: it was not stored "
                f"(store: false), was deleted, or was evicted (this server keeps the "
                f"{state.responses.capacity} most recently used: --max-stored-responses)",
                "invalid_request_error",
                "previous_response_id",
            )
        history = previous.messages
    turn = _Turn(state, req, history)
    try:
        _, streams, turn.choice, turn.parser = await start_chat(
            state, turn.chat_request(), state.trace_headers(raw), turn.id
        )
    except (InvalidParameterError, APIError) as e:
        raise _in_responses_terms(e) from None
    if req.stream:
        return sse_response(_events(turn, streams[0]))
    (final,) = await run_to_end(streams, raw)
    return turn.answer(final)


@router.get("/v1/responses/{response_id}", response_model=None)
async def get_response(response_id: str, state: ServerStateDep, stream: bool = False):
    if stream:
        raise APIError(
            400,
            "stream: replaying a stored response's events is not supported (nor is background mode)",
            "invalid_request_error",
            "stream",
        )
    stored = state.responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored.response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, state: ServerStateDep):
    if not state.responses.delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id")


# -- the request: what is refused, and the chat request it becomes -------------------------------


def _check_supported(req: P.ResponsesRequest) -> None:
    """A 400 naming the first option this server does not implement (none is silently ignored)."""
    refused = [
        ("background", bool(req.background), "background mode is not supported: wait for the answer, or stream it"),
        ("include", bool(req.include), f"{req.include} is not supported (nothing extra can be included)"),
        ("truncation", req.truncation == "auto", '"auto" is not supported: a prompt too long is refused'),
        ("reasoning", bool(req.reasoning and any(v is not None for v in req.reasoning.values())), "not supported"),
        ("max_tool_calls", req.max_tool_calls is not None, "not supported (it counts built-in tool calls)"),
        ("top_logprobs", bool(req.top_logprobs), "not supported"),
        ("prompt", req.prompt is not None, "prompt templates are not supported"),
    ]
    for param, bad, why in refused:
        if bad:
            raise InvalidParameterError(f"{param}: {why}", param)
    for i, tool in enumerate(req.tools):
        if isinstance(tool, P.ResponsesBuiltinTool):
            raise InvalidParameterError(
                f"tools[{i}]: the built-in tool {tool.type!r} is not supported by this server, which runs no "
                "tools itself: give function tools ({'type': 'function', 'name', 'parameters'})",
                "tools",
            )
    meta = req.metadata or {}
    if len(meta) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in meta.items()):
        raise InvalidParameterError(
            "metadata: at most 16 pairs, keys of at most 64 characters, values of at most 512", "metadata"
        )


def _chat_tool_choice(choice: str | dict[str, Any], has_tools: bool) -> str | dict[str, Any]:
    """The Responses API's tool_choice in chat's shape."""
    if isinstance(choice, str):
        return "none" if choice == "auto" and not has_tools else choice  # OpenAI's default, with no tools
    if choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise InvalidParameterError('a named tool_choice is {"type": "function", "name": ...}', "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidParameterError(
        f"tool_choice of type {choice.get('type')!r} is not supported: give 'auto', 'none', 'required' or "
        '{"type": "function", "name": ...}',
        "tool_choice",
    )


def _response_format(text: P.ResponsesTextConfig | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = text.format if text is not None else {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        keys = ("name", "schema", "strict", "description")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}
    raise InvalidParameterError(
        f"text.format.type must be text, json_object or json_schema; got {kind!r}", "text.format.type"
    )


def _chat_messages(items: list[Any]) -> list[P.ChatMessage]:
    """Input items as chat messages: a message as its role (developer as system) and its text; a function_call
    as an assistant message's tool call (after the text of the assistant message it follows: one turn); a
    function_call_output as a tool message."""
    out: list[P.ChatMessage] = []
    for item in items:
        if isinstance(item, P.ResponsesMessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append(P.ChatMessage(role=role, content="".join(p.text for p in item.content)))
        elif isinstance(item, P.ResponsesFunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                calls = (last.model_extra or {}).get("tool_calls") or []
                out[-1] = P.ChatMessage.model_validate(
                    {"role": "assistant", "content": last.content, "tool_calls": [*calls, call]}
                )
            else:
                out.append(P.ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call]}))
        else:
            text = "".join(p.text for p in item.output)
            out.append(P.ChatMessage.model_validate({"role": "tool", "content": text, "tool_call_id": item.call_id}))
    return out


# remapped so an error names the Responses API's field, not the chat request's it became
_PARAMS = {
    "prompt": "input",
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.json_schema": "text.format",
    "response_format.type": "text.format.type",
}


def _in_responses_terms(e: InvalidParameterError | APIError) -> Exception:
    param = e.param
    if param in _PARAMS:
        new = _PARAMS[param]
    elif param is not None and param.startswith("tools["):
        new = param.replace(".function.", ".")  # chat nests a tool's fields under `function`
    else:
        return e
    message = str(e).replace("max_tokens=", "max_output_tokens=") if param == "max_tokens" else str(e)
    if isinstance(e, APIError):
        return APIError(e.status, e.message, e.type, new, e.headers)
    return InvalidParameterError(message, new)


# -- one response ---------------------------------------------------------------------------


class _Turn:
    """One request's response: its echo of the request, the chat request it runs as, its output and storage."""

    def __init__(self, state: ServerState, req: P.ResponsesRequest, history: tuple[P.ChatMessage, ...]):
        self.state, self.req, self.history = state, req, history
        self.id = f"resp_{uuid.uuid4().hex}"
        self.choice: Any = "none"  # the checked tool choice, in chat's shape (set by start_chat)
        self.parser: Any = None  # under tool_choice auto, the server's tool-call parser for this request's tools
        self.input_messages = _chat_messages(req.input)
        defaults = SamplingParams()
        self.base = P.ResponsesResponse(  # in progress: no output yet
            id=self.id,
            created_at=int(time.time()),
            status="in_progress",
            model=req.model or state.served_model_name,
            instructions=req.instructions,
            previous_response_id=req.previous_response_id,
            tools=[t for t in req.tools if isinstance(t, P.ResponsesFunctionTool)],
            tool_choice=req.tool_choice,
            parallel_tool_calls=req.parallel_tool_calls,
            temperature=defaults.temperature if req.temperature is None else req.temperature,
            top_p=defaults.top_p if req.top_p is None else req.top_p,
            max_output_tokens=req.max_output_tokens,
            text=req.text or P.ResponsesTextConfig(),
            metadata=req.metadata or {},
            user=req.user,
            store=req.store,
        )

    def chat_request(self) -> P.ChatCompletionRequest:
        req = self.req
        system = [P.ChatMessage(role="system", content=req.instructions)] if req.instructions is not None else []
        tools = [
            P.ToolDefinition(
                function=P.FunctionDefinition(
                    name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
                )
            )
            for t in self.base.tools
        ]
        return P.ChatCompletionRequest(
            messages=[*system, *self.history, *self.input_messages],
            tools=tools or None,
            tool_choice=_chat_tool_choice(req.tool_choice, bool(tools)),
            max_completion_tokens=req.max_output_tokens,
            response_format=_response_format(req.text),
            **{name: getattr(req, name) for name in _SHARED_FIELDS},
        )

    def answer(self, final: RequestOutput) -> P.ResponsesResponse:
        """The response to the finished answer: a message with its text (if any, or if nothing else), then its
        calls."""
        c = final.outputs[0]
        parallel = self.req.parallel_tool_calls
        content, calls, finish = tool_answer(c.text, c.finish_reason, self.choice, self.parser, parallel)
        items: list[_Item] = [_call_item(call.name, call.arguments) for call in calls]
        if content or not calls:
            items.insert(0, _message_item(content or ""))
        return self.finish(final, items, finish)

    def finish(
        self, final: RequestOutput, items: list[_Item], finish: Any, cut: list[_Item] | None = None
    ) -> P.ResponsesResponse:
        """The finished response (stored if asked), from the answer's output items; those in ``cut`` (calls
        streamed that the answer does not hold whole) are incomplete and stay out of the stored conversation."""
        status: Literal["completed", "incomplete"] = "incomplete" if finish == "length" else "completed"
        cut = cut or []
        for item in items:
            item.status = "incomplete" if any(item is x for x in cut) else status
        prompt, generated = len(final.prompt_token_ids), len(final.outputs[0].token_ids)
        response = self.base.model_copy(
            update=dict(
                status=status,
                incomplete_details=P.ResponsesIncompleteDetails() if status == "incomplete" else None,
                output=items,
                usage=P.ResponsesUsage(
                    input_tokens=prompt,
                    input_tokens_details=P.ResponsesInputTokensDetails(cached_tokens=final.num_cached_tokens),
                    output_tokens=generated,
                    total_tokens=prompt + generated,
                ),
            )
        )
        if self.req.store:
            kept = [item for item in items if all(item is not x for x in cut)]
            output = _chat_messages(_ITEMS.validate_python([item.model_dump() for item in kept]))
            messages = (*self.history, *self.input_messages, *output)
            self.state.responses.put(StoredResponse(response, messages))
        return response


def _message_item(text: str = "") -> P.ResponsesOutputMessage:
    return P.ResponsesOutputMessage(
        id=f"msg_{uuid.uuid4().hex}", status="in_progress", content=[P.ResponsesOutputText(text=text)]
    )


def _call_item(name: str, arguments: str = "") -> P.ResponsesFunctionCall:
    return P.ResponsesFunctionCall(
        id=f"fc_{uuid.uuid4().hex}",
        call_id=f"call_{uuid.uuid4().hex}",
        name=name,
        arguments=arguments,
        status="in_progress",
    )


# -- streaming ------------------------------------------------------------------------------

_EMPTY_TEXT = P.ResponsesOutputText(text="")


def _append(item: _Item, text: str) -> None:
    if isinstance(item, P.ResponsesFunctionCall):
        item.arguments += text
    else:
        item.content[0].text += text


class _Events:
    """One streamed response's events, numbered, as SSE."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, type_: str, **fields: Any) -> str:
        data = {"type": type_, "sequence_number": self.seq}
        data.update({k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in fields.items()})
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _events(turn: _Turn, stream: RequestStream) -> AsyncIterator[str]:
    ev = _Events()
    choice, parser, parallel = turn.choice, turn.parser, turn.req.parallel_tool_calls
    yield ev("response.created", response=turn.base)
    yield ev("response.in_progress", response=turn.base)
    index: dict[str, int] = {}  # item id -> output_index

    def added(item: _Item) -> list[str]:
        """An item opened: shown in progress and empty."""
        at = index[item.id] = len(index)
        if isinstance(item, P.ResponsesFunctionCall):
            call = item.model_copy(update={"arguments": "", "status": "in_progress"})
            return [ev("response.output_item.added", output_index=at, item=call)]
        message = item.model_copy(update={"content": [], "status": "in_progress"})
        return [
            ev("response.output_item.added", output_index=at, item=message),
            ev("response.content_part.added", item_id=item.id, output_index=at, content_index=0, part=_EMPTY_TEXT),
        ]

    def delta(item: _Item, text: str) -> str:
        at = dict(item_id=item.id, output_index=index[item.id])
        if isinstance(item, P.ResponsesFunctionCall):
            return ev("response.function_call_arguments.delta", **at, delta=text)
        return ev("response.output_text.delta", **at, content_index=0, delta=text, logprobs=[])

    def done(item: _Item) -> list[str]:
        at = dict(item_id=item.id, output_index=index[item.id])
        if isinstance(item, P.ResponsesFunctionCall):
            args = ev("response.function_call_arguments.done", **at, name=item.name, arguments=item.arguments)
            return [args, ev("response.output_item.done", output_index=at["output_index"], item=item)]
        text = item.content[0].text
        return [
            ev("response.output_text.done", **at, content_index=0, text=text, logprobs=[]),
            ev("response.content_part.done", **at, content_index=0, part=item.content[0]),
            ev("response.output_item.done", output_index=at["output_index"], item=item),
        ]

    def first_item() -> _Item:
        """The item the streamed text goes into: a named function's call, else the message."""
        return _call_item(choice["function"]["name"]) if isinstance(choice, dict) else _message_item()

    streamed_calls: list[P.ResponsesFunctionCall] = []  # each call seen being written, streamed

    def call_events(calls: list[tuple[str, str]]) -> list[str]:
        """Bring the streamed calls up to ``calls`` (name, arguments so far): a new call's item once, then its
        arguments' new text. Text sent cannot be taken back: arguments that no longer begin with it get no more."""
        events = []
        for i, (name, args) in enumerate(calls[:1] if parallel is False else calls):
            if i == len(streamed_calls):
                streamed_calls.append(_call_item(name))
                events += added(streamed_calls[i])
            item = streamed_calls[i]
            if len(args) > len(item.arguments) and args.startswith(item.arguments):
                events.append(delta(item, args[len(item.arguments) :]))
                item.arguments = args
        return events

    # as the answer arrives: its text, or a named function's arguments, into one item; each call seen being
    # written (under auto hermes' tagged calls and llama3_json's, under required each one) into an item of its own
    streamed: _Item | None = None
    sent, final = 0, None
    scan = LiveCalls(choice, parser)
    async for _, out in merge_streams([stream]):
        c = out.outputs[0]
        upto = stream_upto(c.text, sent, c.finished(), choice, parser)
        text, sent = c.text[sent:upto], upto
        if text:
            if streamed is None:
                streamed = first_item()
                for event in added(streamed):
                    yield event
            _append(streamed, text)
            yield delta(streamed, text)
        if not c.finished():
            for event in call_events(scan(c.text)):
                yield event
        if out.finished:
            final = out
    if final is None:  # ended without an answer (aborted): no response
        return
    # at the end: what `auto` held back and the calls of `auto` or `required`; then each item closed in turn
    c = final.outputs[0]
    finish = c.finish_reason
    calls: list[ParsedCall] = []
    if choice in ("auto", "required"):
        rest, calls, finish = stream_end(c.text, sent, c.finish_reason, choice, parser, parallel)
        if streamed_calls and not calls and choice == "auto":  # calls streamed, none whole: they keep their text
            rest = c.text[sent : parser.streamable(c.text)].rstrip()  # (required's: the message has it, as in chat)
        if rest:
            if streamed is None:
                streamed = _message_item()
                for event in added(streamed):
                    yield event
            _append(streamed, rest)
            yield delta(streamed, rest)
    if streamed is None and not calls:  # no text at all: an empty message, or a named function's empty call
        streamed = first_item()
        for event in added(streamed):
            yield event
    # the calls: those streamed, completed; the rest (one whose arguments were written as a JSON string) whole
    tail = call_events(live_calls(c.text, choice, parser))  # the last step's text too
    tail += call_events([(call.name, call.arguments) for call in calls])
    whole: list[_Item] = []
    for i, call in enumerate(calls):
        live = streamed_calls[i] if i < len(streamed_calls) else None
        if live is not None and (live.name, live.arguments) == (call.name, call.arguments):
            whole.append(live)
        else:  # not streamed, or streamed and then not the call the answer turned out to hold
            fresh = _call_item(call.name, call.arguments)
            tail += [*added(fresh), delta(fresh, fresh.arguments)]
            whole.append(fresh)
    # a streamed call the finished answer does not hold whole stays where it was streamed, incomplete
    cut: list[_Item] = [x for x in streamed_calls if all(x is not w for w in whole)]
    items = sorted([x for x in (streamed, *whole, *cut) if x is not None], key=lambda x: index[x.id])
    response = turn.finish(final, items, finish, cut)  # sets the statuses
    for event in tail:
        yield event
    for item in items:
        if any(item is x for x in cut):  # its arguments never completed: no arguments.done to act on
            yield ev("response.output_item.done", output_index=index[item.id], item=item)
            continue
        for event in done(item):
            yield event
    yield ev("response.incomplete" if response.status == "incomplete" else "response.completed", response=response)
