"""The Responses API (/v1/responses), driven with the official `openai` client against a tiny random model.

The server renders a small ChatML template that shows tools, tool calls and tool results (SmolLM2's own
ignores them), so a test can check what reached the prompt: /tokenize of the chat messages a request should
have become gives the same token count as the response's usage.input_tokens.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from utils import MODEL, TIME_TOOL, WEATHER_TOOL, Server, schemathesis

openai = pytest.importorskip("openai")

MAX_STORED = 4

TEMPLATE = """\
{%- if tools %}<|im_start|>tools
{{ tools | tojson }}<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content or '' }}
{%- for c in m.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}", "arguments": \
{{ c.function.arguments }}}</tool_call>{% endfor %}
{%- if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if think %}<think>{% endif %}{% endif %}"""

# the chat tests' tools in the Responses API's flat shape
WEATHER = {"type": "function", **WEATHER_TOOL["function"]}
TIME = {"type": "function", **TIME_TOOL["function"]}
GREEDY = dict(model=MODEL, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    template = tmp_path_factory.mktemp("responses") / "tools.jinja"
    template.write_text(TEMPLATE)
    s = Server(
        str(tiny_model_factory("llama")),
        "--chat-template",
        str(template),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--max-stored-responses",
        str(MAX_STORED),
    )
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _tokens(server, messages, **kw) -> int:
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages, **kw})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def _error(server, body, status=400) -> dict:
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "hi", **body})
    assert r.status_code == status, r.text
    return r.json()["error"]


def _comparable(response) -> dict:
    """A response without what differs between two runs of the same request: ids, the time and the prefix
    cache's hits (and the `parsed` fields the client's stream helper adds)."""
    d = response.model_dump()
    for key in ("id", "created_at"):
        d.pop(key)
    d["usage"]["input_tokens_details"].pop("cached_tokens")
    for item in d["output"]:
        for key in ("id", "call_id", "parsed_arguments"):
            item.pop(key, None)
        for part in item.get("content", []):
            part.pop("parsed", None)
    return d


# -- text in, text out ------------------------------------------------------------------------


def test_text_input_answers_as_chat_does(client):
    r = client.responses.create(input="Tell me a story", max_output_tokens=8, **GREEDY)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert r.output_text == message.content[0].text and r.output_text
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=8, **GREEDY
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 8
    assert r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert chat.usage.prompt_tokens_details is None  # chat's only with --enable-prompt-tokens-details, as vLLM's
    # the request's settings, echoed
    assert (r.temperature, r.top_p, r.max_output_tokens, r.tool_choice, r.tools) == (0, 1.0, 8, "auto", [])
    assert r.text.format.type == "text" and r.parallel_tool_calls and r.previous_response_id is None


def test_instructions_come_first_as_a_system_message(client, server):
    r = client.responses.create(input="Hi", instructions="Answer in French.", max_output_tokens=6, **GREEDY)
    messages = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(messages=messages, max_tokens=6, **GREEDY)
    assert r.output_text == chat.choices[0].message.content
    assert r.instructions == "Answer in French." and r.usage.input_tokens == _tokens(server, messages)


def test_message_list_input_with_text_parts_and_roles(client, server):
    items = [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": "Name a colour."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Another"}, {"type": "input_text", "text": "?"}],
        },
    ]
    r = client.responses.create(input=items, max_output_tokens=6, metadata={"run": "1"}, user="u-1", **GREEDY)
    messages = [  # developer is the system role of a chat template
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ]
    chat = client.chat.completions.create(messages=messages, max_tokens=6, **GREEDY)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == _tokens(server, messages)
    assert r.metadata == {"run": "1"} and r.user == "u-1"


def test_max_output_tokens_makes_an_incomplete_response(client):
    r = client.responses.create(input="Count to a hundred", max_output_tokens=3, **GREEDY)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


# -- streaming --------------------------------------------------------------------------------


def test_streamed_events_in_order_and_the_last_is_the_non_streamed_response(client):
    kw = dict(input="Stream this", max_output_tokens=10, **GREEDY)
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # as OpenAI ends a response cut by max_output_tokens
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    streamed = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == streamed.output_text
    assert events[2].item.id == events[-2].item.id == streamed.output[0].id == events[4].item_id
    assert streamed.id == events[0].response.id
    assert _comparable(streamed) == _comparable(client.responses.create(**kw))


def test_stream_helper_accumulates_a_completed_response(client):
    """A grammar (text.format json_schema) ends the answer, so it completes; the client's own stream helper
    checks the events' consistency and hands back the final response."""
    fmt = {"type": "json_schema", "name": "answer", "schema": {"enum": ["yes", "no"]}, "strict": True}
    kw = dict(model=MODEL, input="Yes or no?", temperature=0, max_output_tokens=20, text={"format": fmt})
    with client.responses.stream(**kw) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and json.loads(final.output_text) in ("yes", "no")
    assert "".join(deltas) == final.output_text
    assert _comparable(final) == _comparable(client.responses.create(**kw))


# -- function tools ---------------------------------------------------------------------------


def _check_call(item, tools=(WEATHER, TIME)):
    import jsonschema

    tool = next(t for t in tools if t["name"] == item.name)
    jsonschema.validate(json.loads(item.arguments), tool["parameters"])
    assert item.type == "function_call" and item.call_id.startswith("call_") and item.id.startswith("fc_")


def test_function_call_round_trip(client, server):
    question = {"role": "user", "content": "Weather in Paris?"}
    named = {"type": "function", "name": "get_weather"}
    first = client.responses.create(
        model=MODEL, input=[question], tools=[WEATHER, TIME], tool_choice=named, max_output_tokens=60, temperature=0
    )
    (call,) = first.output
    assert call.name == "get_weather" and first.status == "completed" and first.output_text == ""
    _check_call(call)
    assert first.tool_choice.name == "get_weather" and [t.name for t in first.tools] == ["get_weather", "get_time"]
    # the client sends the call back with its result; the model answers with a message
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}
    second = client.responses.create(
        input=[question, *first.output, result], tools=[WEATHER, TIME], max_output_tokens=5, **GREEDY
    )
    assert second.output[0].type == "message" and second.output_text
    # the prompt held the call and its result, as a chat client would send them
    chat_call = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    messages = [
        question,
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": call.call_id},
    ]
    tools = [WEATHER_TOOL, TIME_TOOL]
    assert second.usage.input_tokens == _tokens(server, messages, tools=tools)


def test_required_and_named_calls_stream_as_they_answer(client):
    for choice in ("required", {"type": "function", "name": "get_time"}):
        kw = dict(
            model=MODEL,
            input="What time is it?",
            tools=[WEATHER, TIME],
            tool_choice=choice,
            temperature=1.0,  # seeded: greedy, this random model repeats calls until max_output_tokens
            extra_body={"seed": 1},  # a draw whose calls close within max_output_tokens
        )
        whole = client.responses.create(max_output_tokens=80, **kw)
        assert whole.output and all(item.type == "function_call" for item in whole.output)
        for item in whole.output:
            _check_call(item)
        events = list(client.responses.create(stream=True, max_output_tokens=80, **kw))
        streamed = events[-1].response
        assert events[-1].type == "response.completed" and _comparable(streamed) == _comparable(whole)
        for i, item in enumerate(streamed.output):
            deltas = [
                e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.output_index == i
            ]
            (done,) = [e for e in events if e.type == "response.function_call_arguments.done" and e.output_index == i]
            assert "".join(deltas) == done.arguments == item.arguments and done.item_id == item.id
            assert len(deltas) > 1  # each call's arguments arrive piece by piece, required's too
            added = [e for e in events if e.type == "response.output_item.added" and e.output_index == i]
            assert kinds_before(events, added[0], "response.function_call_arguments.delta", i) == 0


def kinds_before(events, event, kind: str, output_index: int) -> int:
    """How many events of ``kind`` for ``output_index`` came before ``event``: an item is added before its deltas."""
    at = events.index(event)
    return sum(e.type == kind and getattr(e, "output_index", None) == output_index for e in events[:at])


def _forced_call(text_before: str, max_output_tokens: int) -> dict:
    """A request whose answer is ``text_before`` then a hermes-tagged get_weather call (forced by a regex: a
    tiny random model would not write one), under tool_choice auto."""
    call = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", "unit": "c"\}\}</tool_call>'
    return dict(
        input="Weather?",
        tools=[WEATHER, TIME],
        max_output_tokens=max_output_tokens,
        model=MODEL,
        temperature=0,
        extra_body={"structured_outputs": {"regex": text_before + call}},
    )


def test_auto_streams_a_tagged_call_as_it_is_written_and_ends_as_the_non_streamed_response(client):
    """A hermes call in the model's text becomes a function_call item, streamed while it is written: the item
    once, then its arguments in pieces."""
    kw = _forced_call(r"Let me check\.", max_output_tokens=80)
    whole = client.responses.create(**kw)  # tool_choice auto
    assert [item.type for item in whole.output] == ["message", "function_call"]
    assert whole.output_text == "Let me check." and whole.output[1].name == "get_weather"
    _check_call(whole.output[1])
    events = list(client.responses.create(stream=True, **kw))
    streamed = events[-1].response
    assert events[-1].type == "response.completed" and _comparable(streamed) == _comparable(whole)
    kinds = [e.type for e in events]
    added = [i for i, e in enumerate(events) if e.type == "response.output_item.added"]
    assert [events[i].item.type for i in added] == ["message", "function_call"]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 3 and all(e.output_index == 1 and e.item_id == streamed.output[1].id for e in deltas)
    (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(e.delta for e in deltas) == args_done.arguments == streamed.output[1].arguments
    # the call streamed while the answer was written: its first pieces came before the answer's last token
    # would allow, i.e. before the message's text was done
    assert kinds.index("response.function_call_arguments.delta") < kinds.index("response.output_text.done")
    assert events[added[1]].item.status == "in_progress" and events[added[1]].item.arguments == ""


def test_a_streamed_call_cut_short_ends_incomplete_where_it_was_streamed(client):
    """max_output_tokens cuts a tagged call mid-arguments: streamed, its item stays at the index it was announced
    at, incomplete, with no arguments.done (nothing to run); not streamed, the answer is the text."""
    kw = _forced_call(r"Hi\.", max_output_tokens=40)
    whole = client.responses.create(**kw)
    assert whole.status == "incomplete" and [item.type for item in whole.output] == ["message"]
    assert whole.output_text.startswith("Hi.<tool_call>")
    events = list(client.responses.create(stream=True, **kw))
    response = events[-1].response
    assert events[-1].type == "response.incomplete"
    assert [(item.type, item.status) for item in response.output] == [
        ("message", "incomplete"),
        ("function_call", "incomplete"),
    ]
    assert response.output[0].content[0].text == "Hi." and response.output[1].name == "get_weather"
    for e in events:  # every event's output_index is its item's place in the response
        if e.type in ("response.output_item.added", "response.output_item.done"):
            assert response.output[e.output_index].id == e.item.id
    assert not any(e.type == "response.function_call_arguments.done" for e in events)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == response.output[1].arguments and deltas.startswith('{"')  # as far as it got
    with pytest.raises(json.JSONDecodeError):
        json.loads(deltas)


def test_parallel_tool_calls_false_makes_one_call(client):
    r = client.responses.create(
        model=MODEL,
        input="Weather and time?",
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=90,
        temperature=1.0,
        extra_body={"seed": 3},
    )
    assert len(r.output) == 1 and r.parallel_tool_calls is False
    _check_call(r.output[0])


# -- stored responses and previous_response_id -------------------------------------------------


def test_previous_response_id_continues_the_conversation(client, server):
    first = client.responses.create(input="My name is Ada.", instructions="Be kind.", max_output_tokens=4, **GREEDY)
    second = client.responses.create(
        input="What is my name?", previous_response_id=first.id, max_output_tokens=4, **GREEDY
    )
    assert second.previous_response_id == first.id
    # the first turn, its answer, then the new input; the first's instructions are not carried on (OpenAI's rule)
    messages = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.usage.input_tokens == _tokens(server, messages)
    third = client.responses.create(input="And again?", previous_response_id=second.id, max_output_tokens=4, **GREEDY)
    messages += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "And again?"}]
    assert third.usage.input_tokens == _tokens(server, messages) > second.usage.input_tokens


def test_get_and_delete_a_stored_response(client, server):
    r = client.responses.create(input="Remember me", max_output_tokens=3, **GREEDY)
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    err = _error(server, {"previous_response_id": r.id})
    assert err["param"] == "previous_response_id" and r.id in err["message"]
    unstored = client.responses.create(input="Forget me", store=False, max_output_tokens=3, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_store_keeps_the_most_recently_used_under_random_operations():
    import random
    from collections import OrderedDict

    from pagedllm.entrypoints.openai import protocol as P
    from pagedllm.entrypoints.openai.response_store import ResponseStore, StoredResponse

    rng = random.Random(0)
    store, model = ResponseStore(3), OrderedDict()  # the model: id -> None, least recently used first
    for _ in range(500):
        rid, op = f"resp_{rng.randrange(6)}", rng.choice(["put", "get", "delete"])
        if op == "put":
            store.put(StoredResponse(P.ResponsesResponse(id=rid, status="completed", model=MODEL), ()))
            model[rid] = None
            model.move_to_end(rid)
            while len(model) > 3:
                model.popitem(last=False)
        elif op == "get":
            assert (store.get(rid) is not None) == (rid in model)
            if rid in model:
                model.move_to_end(rid)
        else:
            assert store.delete(rid) == (model.pop(rid, 0) is None)
        store.check_invariants()
        assert len(store) == len(model)


def test_the_store_is_bounded_in_bytes_and_frees_them_on_delete():
    """Clients choose fields the store keeps (a 3.9 MB ``user`` each held 4.3 GB at 1,000 responses): the store
    counts each response's bytes, evicts the least recently used past max_bytes, and refuses one larger than all."""
    from pagedllm.entrypoints.openai import protocol as P
    from pagedllm.entrypoints.openai.response_store import ResponseStore, StoredResponse

    def big(rid: str, n: int) -> StoredResponse:
        return StoredResponse(P.ResponsesResponse(id=rid, status="completed", model=MODEL, user="u" * n), ())

    store = ResponseStore(1000, max_bytes=1 << 20)
    for i in range(20):
        assert store.put(big(f"resp_{i}", 200_000))
        store.check_invariants()
        assert store.bytes <= 1 << 20
    assert len(store) == 5 and store.get("resp_19") is not None and store.get("resp_14") is None
    held = store.bytes
    assert store.delete("resp_19") and store.bytes < held - 200_000
    assert not store.put(big("resp_huge", 2 << 20)) and store.get("resp_huge") is None
    store.check_invariants()


def test_the_least_recently_used_response_is_evicted(client, server):
    ids = [client.responses.create(input=f"Turn {i}", max_output_tokens=2, **GREEDY).id for i in range(MAX_STORED)]
    client.responses.retrieve(ids[0])  # now the most recently used: ids[1] goes first
    newest = client.responses.create(input="One more", max_output_tokens=2, **GREEDY).id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])
    for kept in (ids[0], *ids[2:], newest):
        assert client.responses.retrieve(kept).id == kept
    err = _error(server, {"previous_response_id": ids[1]})
    assert err["param"] == "previous_response_id" and "--max-stored-responses" in err["message"]


def test_a_chain_past_the_context_window_is_the_too_long_prompt_400(client, server):
    words = " ".join(["lorem ipsum"] * 30)
    previous = None
    for _ in range(10):
        try:
            previous = client.responses.create(
                input=words, previous_response_id=previous, max_output_tokens=4, **GREEDY
            ).id
        except openai.BadRequestError as e:
            assert e.body["param"] == "input" and "max_model_len" in e.body["message"]
            return
    pytest.fail("a chain of 10 long turns still fit the 256-token context")


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param, says",
    [
        ({"previous_response_id": "resp_unknown"}, "previous_response_id", "resp_unknown"),
        ({"background": True}, "background", "background"),
        ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools", "file_search"),
        (
            {"tools": [{**WEATHER, "parameters": {"type": "object", "properties": {"city": {"type": "strin"}}}}]},
            "tools[0].parameters",
            "get_weather",
        ),
        (
            {"tools": [{**WEATHER, "parameters": {"type": "object", "required": "city"}}]},
            "tools[0].parameters",
            "required",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "web_search_preview"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"truncation": "auto"}, "truncation", "auto"),
        ({"include": ["message.output_text.logprobs"]}, "include", "logprobs"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
        ({"conversation": "conv_1"}, "conversation", "not permitted"),
        ({"max_output_tokens": 100000}, "max_output_tokens", "max_output_tokens=100000"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type", "xml"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "16"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0", "reasoning"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0",
            "input_text",
        ),
        ({"input": [{"role": "user", "content": "x"}] * 2049}, "input", "--max-messages"),
    ],
)
def test_unsupported_or_bad_requests_get_400_naming_the_field(server, body, param, says):
    err = _error(server, body)
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    assert err["param"] == param or err["param"].startswith(param + "."), err
    assert says in err["message"], err


_SHORT_ANSWERS_HOOK = """
import schemathesis


@schemathesis.hook
def before_call(context, case, kwargs):
    if isinstance(case.body, dict) and case.body.get("max_output_tokens") is None:
        case.body["max_output_tokens"] = 2
"""


@pytest.mark.slow
def test_schemathesis_finds_no_server_errors_in_the_responses_api(server, tmp_path):
    """Fuzz /v1/responses and GET / DELETE /v1/responses/{id}; any 5xx fails. A fuzzed body without a
    max_output_tokens gets 2: the shapes are the point, and most fuzzed bodies are valid requests that would
    otherwise each generate to the context's end (on a busy 2-core machine: 14 minutes instead of 15 seconds)."""
    hook = tmp_path / "short_answers.py"
    hook.write_text(_SHORT_ANSWERS_HOOK)
    r = schemathesis(
        server.url,
        *("--include-path-regex", "^/v1/responses", "--checks", "not_a_server_error", "--max-examples", "20"),
        env={"SCHEMATHESIS_HOOKS": str(hook)},
    )
    assert r.returncode == 0, r.stdout[-4000:]
    assert re.search(r"[1-9]\d* generated, [1-9]\d* passed", r.stdout), r.stdout[-2000:]


def test_the_openai_client_raises_bad_request_for_background(client):
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model=MODEL, input="hi", background=True)


def test_get_of_an_unknown_response_is_404(server):
    r = httpx.get(f"{server.url}/v1/responses/resp_nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"


# -- /tokenize with tools ----------------------------------------------------------------------


def test_tokenize_takes_tools_and_chat_template_kwargs(server):
    messages = [{"role": "user", "content": "Weather?"}]
    plain = _tokens(server, messages)
    assert _tokens(server, messages, tools=[WEATHER_TOOL]) > plain
    assert _tokens(server, messages, chat_template_kwargs={"think": True}) > plain
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "x", "tools": [WEATHER_TOOL]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": []}}}
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "tools": [bad]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters"
