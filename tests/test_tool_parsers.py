"""The tool-call parsers for tool_choice "auto": whole answers and the streamed prefix they hold back."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.tool_calls import TOOL_PARSERS, forced_schema, parse_forced, schema_problem


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
    from pagedllm.entrypoints.openai.server import _chat_ids
    from pagedllm.model_loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    template = (
        "{% for t in tools or [] %}[TOOL {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [ChatMessage(role="user", content="hi")]
    assert tok.decode(_chat_ids(tok, msgs, template, True, None, tools)) == "[TOOL get_weather]hi"
    assert tok.decode(_chat_ids(tok, msgs, template, True, None, None)) == "hi"
