"""The tool-call parsers for tool_choice "auto": whole answers and the streamed prefix they hold back."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedllm.entrypoints.openai.tool_calls import (
    TOOL_PARSERS,
    forced_schema,
    parse_forced,
    required_stream_calls,
    schema_problem,
)

from utils import TIME_TOOL, WEATHER_TOOL


def test_hermes_extracts_calls_and_keeps_the_content_before_them():
    p = TOOL_PARSERS["hermes"]()
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>'
    )
    content, calls = p.extract(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {"tz": "CET"}),
    ]
    assert p.extract("no calls here") == ("no calls here", [])
    broken = "<tool_call>{not json}</tool_call>"
    assert p.extract(broken) == (broken, [])  # not a call after all: the text stays content
    # streaming: nothing that may begin "<tool_call>" goes out as content
    assert p.streamable("Hello <tool") == len("Hello ")
    assert p.streamable("Hello <tool_call>{") == len("Hello ")
    assert p.streamable("Hello world") == len("Hello world")
    assert p.streamable("a < b") == len("a < b")


def test_hermes_streams_each_tagged_call_as_it_is_written():
    """Fed the answer a character at a time, stream_calls shows each call once its name is complete, with its
    arguments' text so far; the pieces add up to what extract() returns for the whole answer, as written."""
    p = TOOL_PARSERS["hermes"]().for_tools([WEATHER_TOOL, TIME_TOOL])
    text = (
        'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "S\\"ão}", "unit":"c"}}\n</tool_call>'
        '<tool_call>{"arguments": {"tz": "CET"}, "name": "get_time"}</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
    )
    seen: list[list[tuple[str, str]]] = []
    for i in range(len(text) + 1):
        now = p.stream_calls(text[:i])
        for j, (name, args) in enumerate(now):  # a call's name never changes; its arguments only grow
            if j < len(seen):
                assert name == seen[j][-1][0] and args.startswith(seen[j][-1][1])
                seen[j].append((name, args))
            else:
                seen.append([(name, args)])
        assert p.streamable(text[:i]) <= len("Checking.")
    content, calls = p.extract(text)
    assert content == "Checking."
    assert [c.name for c in calls] == ["get_weather", "get_time", "get_time"]
    assert calls[0].arguments == '{"city": "S\\"ão}", "unit":"c"}'  # as written, not re-serialized
    assert [s[-1] for s in seen[:2]] == [(c.name, c.arguments) for c in calls[:2]]
    assert len({a for _, a in seen[0]}) > 10  # the first call's arguments arrived in many pieces
    # the second call shows up only once its name is complete: with all of its arguments written before it
    assert seen[1][0] == ("get_time", '{"tz": "CET"}')
    # arguments written as a JSON string are not streamed (their text is not the arguments): sent at the end
    assert seen[2][-1] == ("get_time", "") and json.loads(calls[2].arguments) == {"tz": "UTC"}


# Qwen2.5-Coder 1.5B and 0.5B, asked by their template for <tool_call> tags, answer with the call as plain JSON
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
UNTAGGED = [
    (PARIS, None),  # bare, as llama.cpp's run of the 1.5B answers
    (f"```json\n{PARIS}\n```", None),  # fenced, as ours did
    (f"Let me look that up.\n\n```json\n{PARIS}\n```\n", "Let me look that up."),
    (f"```\n{PARIS}\n```", None),
    (PARIS.replace('"arguments"', '"parameters"'), None),
]


@pytest.mark.parametrize(("text", "content"), UNTAGGED)
def test_hermes_takes_untagged_calls_to_offered_tools(text, content):
    p = TOOL_PARSERS["hermes"]().for_tools([WEATHER_TOOL, TIME_TOOL])
    got, calls = p.extract(text)
    assert got == content and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"})
    ]
    # streamed: everything from where the call may begin is held back, the text before it goes out
    start = min(text.find(c) for c in ("`", "{") if c in text)
    assert all(p.streamable(text[:k]) <= start for k in range(len(text) + 1))
    assert p.streamable(text) == start


def test_hermes_takes_parallel_untagged_calls():
    p = TOOL_PARSERS["hermes"]().for_tools([WEATHER_TOOL, TIME_TOOL])
    oslo = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f"}}'
    for text in (f"{PARIS}\n{oslo}", f"[{PARIS}, {oslo}]", f"```json\n[{PARIS},\n {oslo}]\n```"):
        content, calls = p.extract(text)
        assert content is None and [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Oslo"]


@pytest.mark.parametrize(("text", "content"), UNTAGGED)
def test_hermes_streams_untagged_calls_as_they_are_written(text, content):
    p = TOOL_PARSERS["hermes"]().for_tools([WEATHER_TOOL, TIME_TOOL])
    seen = _fed_a_character_at_a_time(p.stream_calls, text)
    _, calls = p.extract(text)
    assert [s[-1] for s in seen] == [(c.name, c.arguments) for c in calls]  # the end adds up to the answer's calls
    assert len(seen[0]) > 10  # the arguments arrived in many pieces
    assert seen[0][0] == ("get_weather", "{")  # from where they begin: a tool's name alone is no call yet
    assert p.stream_calls(text.replace('"get_weather", ', '"get_weather", "id": 3, ')) == []  # more than a call


def test_hermes_streams_parallel_untagged_calls_and_keeps_them_as_written():
    p = TOOL_PARSERS["hermes"]().for_tools([WEATHER_TOOL, TIME_TOOL])
    oslo = '{"name":"get_weather","arguments":{"city":"Oslo","unit":"f"}}'  # written without blanks
    for text in (f"{PARIS}\n{oslo}", f"{PARIS};{oslo}", f"[{PARIS}, {oslo}]", f"```json\n[{PARIS},\n {oslo}]\n```"):
        seen = _fed_a_character_at_a_time(p.stream_calls, text)
        content, calls = p.extract(text)
        assert content is None and [s[-1] for s in seen] == [(c.name, c.arguments) for c in calls]
        assert calls[1].arguments == '{"city":"Oslo","unit":"f"}'  # as written, which is what streaming sent


ORDINARY_JSON = [
    '{"city": "Paris", "unit": "c"}',  # the arguments alone: the user asked for a JSON record
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',  # misses the required unit
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}',  # not in the enum
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}, "id": 3}',  # more than a call
    '{"name": "get_forecast", "arguments": {"city": "Paris", "unit": "c"}}',  # a tool nobody offered
    '{"name": "Paris", "population": 2100000}',
    f'[{PARIS}, {{"name": "Ada"}}]',  # one of them not a call: none taken
    f"```python\nprint({PARIS!r})\n```",
    f"```json\n{PARIS}\n```\nand then some more text",
    f"Text first, then {PARIS}",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}',  # cut short
]


# the ordinary answers a stream shows as a call while it is written (one that ends as no call is sent as content
# too, as a tagged call whose JSON turns out malformed): those that name an offered tool and begin its arguments
STREAMED_AS_WRITTEN = {1, 2, 3, 6, 8, 10}


@pytest.mark.parametrize("i", range(len(ORDINARY_JSON)))
def test_hermes_leaves_ordinary_json_answers_as_text(i):
    text = ORDINARY_JSON[i]
    p = TOOL_PARSERS["hermes"]().for_tools([WEATHER_TOOL, TIME_TOOL])
    assert p.extract(text) == (text, [])
    streamed = any(p.stream_calls(text[:k]) for k in range(len(text) + 1))
    assert streamed == (i in STREAMED_AS_WRITTEN)
    # with no tools offered nothing is held back or taken (the server's unbound parser)
    assert TOOL_PARSERS["hermes"]().extract(PARIS) == (PARIS, [])
    assert TOOL_PARSERS["hermes"]().streamable(PARIS) == len(PARIS)


def test_untagged_hold_releases_code_that_is_not_a_call():
    p = TOOL_PARSERS["hermes"]().for_tools([WEATHER_TOOL])
    assert p.streamable("Sure: `") == len("Sure: ")
    assert p.streamable("Sure: ```js") == len("Sure: ")  # may still become "json"
    assert p.streamable("Sure: ```python\nx = 1") == len("Sure: ```python\nx = 1")
    assert p.streamable("Use `x` here") == len("Use `x` here")
    assert p.streamable("```python\nx = 1\n```\nThat sets x.") == len("```python\nx = 1\n```\nThat sets x.")
    assert p.streamable("   ") == 0 and p.streamable("  [1, ") == 2


def _fed_a_character_at_a_time(stream_calls, text: str) -> list[list[tuple[str, str]]]:
    """Each call's successive (name, arguments so far) as ``stream_calls`` shows them for every prefix of
    ``text``; a call's name never changes and its arguments only grow."""
    seen: list[list[tuple[str, str]]] = []
    for i in range(len(text) + 1):
        for j, (name, args) in enumerate(stream_calls(text[:i])):
            if j < len(seen):
                assert name == seen[j][-1][0] and args.startswith(seen[j][-1][1]), (text[:i], seen[j][-1])
                if args != seen[j][-1][1]:
                    seen[j].append((name, args))
            else:
                seen.append([(name, args)])
    return seen


def test_llama3_json_streams_each_call_as_it_is_written():
    p = TOOL_PARSERS["llama3_json"]().for_tools([WEATHER_TOOL, TIME_TOOL])
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "S\\"ão}", "unit":"c"}}; '
        '{"parameters": {"tz": "CET"}, "name": "get_time"};{"name": "get_time", "parameters": {}}'
    )
    seen = _fed_a_character_at_a_time(p.stream_calls, text)
    content, calls = p.extract(text)
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time", "get_time"]
    assert calls[0].arguments == '{"city": "S\\"ão}", "unit":"c"}'  # as written, which is what was streamed
    assert [s[-1] for s in seen] == [(c.name, c.arguments) for c in calls]
    assert len(seen[0]) > 10  # the first call's arguments arrived in many pieces
    assert seen[1][0] == ("get_time", '{"tz": "CET"}')  # its name came after its arguments
    # nothing is content while a call may be written, and plain text shows no call
    assert all(p.streamable(text[:i]) == 0 for i in range(len(text) + 1))
    assert p.stream_calls("Sure, the weather is fine.") == []


def test_required_calls_stream_as_their_array_is_written():
    tools = [WEATHER_TOOL, TIME_TOOL]
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "f"}},\n'
        ' {"name": "get_time", "parameters": {"tz": "CET"}}]'
    )
    jsonschema.validate(json.loads(text), forced_schema(tools, "required"))
    seen = _fed_a_character_at_a_time(required_stream_calls, text)
    calls = parse_forced(text, "required")
    assert [s[-1] for s in seen] == [(c.name, c.arguments) for c in calls]
    assert calls[1].arguments == '{"tz": "CET"}' and all(len(s) > 5 for s in seen)
    # a control character the grammar let into a string: the call keeps strict JSON (re-serialized)
    # a control character the grammar let into a string: escaped as it streams, so the pieces still add up to
    # the arguments, which are strict JSON
    raw = '[{"name": "get_time", "parameters": {"tz": "a\tb\n"}}]'
    seen = _fed_a_character_at_a_time(required_stream_calls, raw)
    (call,) = parse_forced(raw, "required")
    assert seen[0][-1] == (call.name, call.arguments) == ("get_time", '{"tz": "a\\tb\\n"}')
    assert json.loads(call.arguments) == {"tz": "a\tb\n"}


def test_llama3_json_reads_one_or_more_calls():
    p = TOOL_PARSERS["llama3_json"]()
    content, calls = p.extract('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert p.extract("Just text.") == ("Just text.", [])
    assert p.extract('{"no_name": 1}') == ('{"no_name": 1}', [])
    assert p.streamable('{"name"') == 0 and p.streamable("Sure, here") == len("Sure, here")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_forced_schemas_and_their_answers(choice):
    import jsonschema

    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
            },
        },
        {"type": "function", "function": {"name": "g"}},
    ]
    schema = forced_schema(tools, choice)
    answer = (
        '{"q": "x"}'
        if isinstance(choice, dict)
        else '[{"name": "f", "parameters": {"q": "x"}}, {"name": "g", "parameters": {}}]'
    )
    jsonschema.validate(json.loads(answer), schema)
    calls = parse_forced(answer, choice)
    assert calls[0].name == "f" and json.loads(calls[0].arguments) == {"q": "x"}
    if choice == "required":
        assert calls[1].name == "g"
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "h", "parameters": {}}], schema)  # only the tools given
        assert parse_forced('[{"name": "f", "param', choice) == []  # cut short by max_tokens
        # a control character the grammar let into a string does not lose the calls
        assert parse_forced('[{"name": "g", "parameters": {"q": "a\x05"}}]', choice)[0].name == "g"
        with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls false: one call exactly
            jsonschema.validate(json.loads(answer), forced_schema(tools, choice, parallel=False))


SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]+$"}}, "required": ["a"]},
    {"type": "object", "properties": {"b": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]}}},
    {"type": "object", "$defs": {"x": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/x"}}},
    {"type": "object", "additionalProperties": False, "properties": {"x": True, "y": {"items": [{}, {}]}}},
    {"type": ["object", "null"], "properties": {"t": {"enum": ["a", 1, None]}, "n": {"multipleOf": 0.5}}},
    {"type": "object", "properties": {"a": {"type": "strin"}}},
    {"type": "object", "required": "a"},
    {"type": "object", "required": ["a", "a"]},
    {"type": "object", "properties": []},
    {"type": "object", "properties": {"a": {"items": 3}}},
    {"type": ["string", "string"]},
    {"type": "object", "properties": {"a": {"minLength": -1}}},
    {"type": "object", "properties": {"a": {"maxItems": 1.5}}},
    {"type": "object", "properties": {"a": {"anyOf": []}}},
    {"type": "object", "properties": {"a": {"multipleOf": 0}}},
    {"type": "object", "properties": {"a": {"pattern": "["}}},
    {"enum": 3},
    {"type": "object", "properties": {"a": {"description": 5}}},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_schema_check_agrees_with_json_schemas_meta_schema(schema):
    """Valid as draft 2020-12 or draft 7 describes it (the tuple form of `items` is draft 7's)."""
    import jsonschema

    valid = False
    for validator in (jsonschema.Draft202012Validator, jsonschema.Draft7Validator):
        try:
            validator.check_schema(schema)
            valid = True
        except jsonschema.SchemaError:
            pass
    if "pattern" in json.dumps(schema) and valid:  # jsonschema checks the regex only with a format checker
        valid = schema_problem(schema) is None
    assert (schema_problem(schema) is None) == valid, schema_problem(schema)


def test_tools_reach_the_chat_template():
    from pagedllm.entrypoints.openai.protocol import ChatMessage
    from pagedllm.entrypoints.openai.server import _chat_prompt
    from pagedllm.model_loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    template = (
        "{% for t in tools or [] %}[TOOL {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [ChatMessage(role="user", content="hi")]
    assert tok.decode(_chat_prompt(tok, msgs, template, True, None, tools)[0]) == "[TOOL get_weather]hi"
    assert tok.decode(_chat_prompt(tok, msgs, template, True, None, None)[0]) == "hi"


def test_a_long_call_streams_in_pieces_for_work_linear_in_its_length():
    """A `required` call whose arguments run to 40,000 characters, fed 4 characters a step (about a token): the
    scans read a constant times its length in all, not its square, and the pieces still come in many steps."""
    from pagedllm.entrypoints.openai.serving_chat import LiveCalls

    text = '[{"name": "write_file", "parameters": {"path": "a.py", "body": "' + "x = 1\\n" * 6000 + '"}}]'
    scan = LiveCalls("required", None)
    seen = []
    for i in range(0, len(text) + 4, 4):
        calls = scan(text[: i + 4])
        if calls and (not seen or calls[0][1] != seen[-1]):
            assert not seen or calls[0][1].startswith(seen[-1])
            seen.append(calls[0][1])
    # every step below FREE characters (at most FREE a step), then about GROWTH times the length; a scan at every
    # step would read len(text) ** 2 / 8 characters, 80 times more
    assert scan.work < LiveCalls.FREE**2 / 8 + (LiveCalls.GROWTH + 2) * len(text) < len(text) ** 2 / 80
    # many pieces, each the start of the whole call's arguments (the rest goes out with the answer's end)
    whole = parse_forced(text, "required")[0].arguments
    assert len(seen) > LiveCalls.GROWTH and whole.startswith(seen[-1]) and len(seen[-1]) > 0.9 * len(whole)
    assert required_stream_calls(text) == [("write_file", whole)]
