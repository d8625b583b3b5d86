"""Tool calling that a model really does: Qwen2.5-Coder-0.5B-Instruct, served with the hermes parser and
``tool_choice: auto``, driven by the official openai client. Its template asks for ``<tool_call>`` tags; at this
size it answers with the bare JSON call, which the parser takes when it names an offered tool and its arguments
validate (tests/test_tool_parsers.py has the cases, ordinary JSON answers among them)."""

from __future__ import annotations

import json

import pytest

from utils import MODEL, Server

openai = pytest.importorskip("openai")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
    },
}
RAIN = [{"role": "user", "content": "Is it raining in Lisbon right now?"}]
ASK = dict(model=MODEL, tools=[WEATHER], max_tokens=48, temperature=0)


@pytest.fixture(scope="module")
def client(qwen_0_5b):
    s = Server(
        str(qwen_0_5b),
        "--max-model-len",
        "1024",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
    s.stop()


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.slow
def test_a_weather_question_gets_a_real_call_streamed_or_not_then_an_answer_from_its_result(client):
    out = client.chat.completions.create(messages=RAIN, **ASK)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and not message.content
    ((name, args),) = _calls(message)
    assert name == "get_weather" and isinstance(args["city"], str) and args["city"].startswith("Lisbo")
    call = message.tool_calls[0]
    assert call.id and call.type == "function"

    # streamed: the openai client's way of assembling deltas gives the same call, its id and name sent once, its
    # arguments in pieces as the model writes them (untagged as it is, once it names the tool and they begin)
    pieces: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(messages=RAIN, stream=True, **ASK):
        delta = chunk.choices[0].delta
        assert not delta.content  # nothing of the call leaks out as text
        for d in delta.tool_calls or []:
            got = pieces.setdefault(d.index, {"ids": [], "names": [], "arguments": "", "chunks": 0})
            got["ids"] += [d.id] if d.id else []
            got["names"] += [d.function.name] if d.function and d.function.name else []
            got["arguments"] += (d.function.arguments or "") if d.function else ""
            got["chunks"] += bool(d.function and d.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(pieces) == [0]
    assert len(pieces[0]["ids"]) == 1 and pieces[0]["names"] == ["get_weather"]
    assert pieces[0]["arguments"] == call.function.arguments and pieces[0]["chunks"] > 2

    # the round trip: the tool's result comes back as a `tool` message; the answer is text that uses it
    history = [
        *RAIN,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": "Lisbon", "rain_mm_per_h": 4.2})},
    ]
    final = client.chat.completions.create(messages=history, **{**ASK, "max_tokens": 64})
    answer = final.choices[0].message
    assert not answer.tool_calls and answer.content and final.choices[0].finish_reason in ("stop", "length")
    assert "rain" in answer.content.lower() or "4.2" in answer.content


@pytest.mark.slow
def test_questions_that_need_no_tool_get_text_even_when_the_answer_is_json(client):
    haiku = client.chat.completions.create(
        messages=[{"role": "user", "content": "Write a haiku about the sea."}], **ASK
    )
    assert haiku.choices[0].finish_reason in ("stop", "length") and not haiku.choices[0].message.tool_calls
    assert haiku.choices[0].message.content
    # asked for JSON with a tool offered: the model writes {"name": "Ada", ...}, not a call to an offered tool
    record = client.chat.completions.create(
        messages=[{"role": "user", "content": "Give me a JSON object with the fields name and age for Ada, 36."}],
        **ASK,
    )
    message = record.choices[0].message
    assert not message.tool_calls and "Ada" in message.content
