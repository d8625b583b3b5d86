"""Structured outputs on the embedded SmolLM2: every constrained output validates.

32 JSON schemas (nested objects, arrays with bounds, enums, patterns, numeric bounds,
anyOf, $ref, ...) greedy and seeded-sampled, regexes (fullmatch), choices and an
EBNF arithmetic grammar (parsed back) all hold 100 %. Unconstrained requests give
the same tokens beside constrained ones as alone; with n-gram speculation the
constrained outputs do not change. Bad specs are refused naming the field.
"""

from __future__ import annotations

import ast
import json
import re
import time

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidParameterError
from pagedllm.sampling_params import StructuredOutputsParams as SO

# strings and numbers are bounded: a free integer lets a small model write digits until max_tokens
S = {"type": "string", "maxLength": 16}
INT = {"type": "integer", "minimum": -999, "maximum": 9999}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {"user": {"type": "object", "properties": {"id": INT, "email": S}, "required": ["id", "email"]}},
        "required": ["user"],
    },
    {"type": "array", "items": S, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {"type": "object", "properties": {"t": {"type": "number", "minimum": -10.5, "maximum": 40}}, "required": ["t"]},
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "exclusiveMinimum": 5, "maximum": 99}},
        "required": ["n"],
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": S}, "required": ["ok"]},
    {"type": "object", "properties": {"v": {"anyOf": [INT, S]}}, "required": ["v"]},
    {
        "$defs": {"pt": {"type": "object", "properties": {"x": INT, "y": INT}, "required": ["x", "y"]}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
        "required": ["a", "b"],
    },
    {
        "type": "array",
        "items": {"type": "object", "properties": {"k": S, "v": INT}, "required": ["k", "v"]},
        "maxItems": 2,
    },
    {"type": "object", "properties": {"kind": {"const": "event"}, "id": INT}, "required": ["kind", "id"]},
    {"type": "object", "properties": {"nick": {"type": ["string", "null"], "maxLength": 10}}, "required": ["nick"]},
    {
        "type": "object",
        "properties": {
            "title": S,
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "tags": {"type": "array", "items": S, "maxItems": 2},
        },
        "required": ["title"],
    },
    {"type": "object", "properties": {"a": INT}, "required": ["a"], "additionalProperties": False},
    {"type": "array", "items": {"type": "array", "items": INT, "maxItems": 3}, "maxItems": 2},
    {
        "type": "object",
        "properties": {"code": {"type": "string", "minLength": 2, "maxLength": 4}},
        "required": ["code"],
    },
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}}, "required": ["level"]},
    {
        "type": "object",
        "properties": {
            "days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "minItems": 1, "maxItems": 3}
        },
        "required": ["days"],
    },
    {"type": "array", "prefixItems": [INT, S], "items": False, "minItems": 2},
    {
        "type": "object",
        "properties": {
            "l1": {
                "type": "object",
                "properties": {"l2": {"type": "object", "properties": {"l3": INT}, "required": ["l3"]}},
                "required": ["l2"],
            }
        },
        "required": ["l1"],
    },
    {"type": "boolean"},
    {"type": "integer", "minimum": 0, "maximum": 1000},
    {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 100}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}, "required": ["id"]},
    {
        "type": "object",
        "properties": {
            "status": {
                "anyOf": [{"const": "ok"}, {"type": "object", "properties": {"error": S}, "required": ["error"]}]
            }
        },
        "required": ["status"],
    },
    {"type": "object", "properties": {"p": {"type": "number", "exclusiveMaximum": 1, "minimum": 0}}, "required": ["p"]},
    {
        "type": "object",
        "properties": {"name": S, "friends": {"type": "array", "items": {"$ref": "#/$defs/f"}, "maxItems": 2}},
        "$defs": {"f": {"type": "object", "properties": {"name": S}, "required": ["name"]}},
        "required": ["name", "friends"],
    },
    {"type": "object", "properties": {"a": S, "b": S, "c": S}, "required": ["a", "b", "c"]},
    {"enum": ["alpha", "beta", 3, None]},
    {
        "type": "object",
        "properties": {"score": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["score"],
        "minProperties": 1,
    },
    {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"},  # a pattern overrides maxLength
]

ARITH = r"""
root ::= term (op term){0,3}
term ::= num | "(" num op num ")"
op ::= " + " | " - " | " * "
num ::= [1-9] | [1-9] [0-9]
"""


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def llm(request):
    """Every test runs on both backends."""
    return LLM(max_model_len=1024, structured_outputs_config={"backend": request.param})


def _chat(llm: LLM, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )


def test_json_schemas_always_validate(llm):
    assert len(SCHEMAS) >= 30
    for schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        prompt = _chat(llm, f"Reply with JSON for this schema: {json.dumps(schema)}")
        for p in (
            SamplingParams(max_tokens=200, temperature=0, structured_outputs=SO(json=schema)),
            SamplingParams(max_tokens=200, temperature=1.0, seed=i, structured_outputs=SO(json=schema)),
        ):
            prompts.append(prompt)
            params.append(p)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs, params):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.text, p.structured_outputs.json)
        jsonschema.validate(json.loads(c.text), p.structured_outputs.json)
    stats = llm.llm_engine.structured.make_stats()
    assert stats["num_constrained_requests"] >= 2 * len(SCHEMAS)
    assert any(hit for _, hit in stats["compile_seconds"])  # the seeded run reused the greedy run's compile


def test_regex_choice_grammar_and_json_object(llm):
    cases = [
        (r"\d{3}-\d{4}", "A phone number, please."),
        (r"(yes|no)", "Is the sky blue?"),
        (r"[A-Z][a-z]{2,8}", "Name a city."),
        (r"#[0-9a-f]{6}", "A color in hex."),
    ]
    prompts, params = [], []
    for i, (rx, q) in enumerate(cases):
        for t in (0, 0.9):
            prompts.append(_chat(llm, q))
            params.append(SamplingParams(max_tokens=30, temperature=t, seed=i, structured_outputs=SO(regex=rx)))
    choices = ["positive", "negative", "neutral", "café"]
    for t in (0, 1.0):
        prompts.append(_chat(llm, "Is 'I love it' positive or negative?"))
        params.append(SamplingParams(max_tokens=10, temperature=t, seed=3, n=3, structured_outputs=SO(choice=choices)))
    for t in (0, 1.0):
        prompts.append(_chat(llm, "Write an arithmetic expression."))
        params.append(SamplingParams(max_tokens=60, temperature=t, seed=5, structured_outputs=SO(grammar=ARITH)))
        prompts.append(_chat(llm, 'Return this JSON object: {"ok": true, "n": 2}'))
        params.append(SamplingParams(max_tokens=300, temperature=t, seed=6, structured_outputs=SO(json_object=True)))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs, params):
        so = p.structured_outputs
        for c in out.outputs:
            assert c.finish_reason == "stop", (c.text, so)
            if so.regex:
                assert re.fullmatch(so.regex, c.text), (c.text, so.regex)
            elif so.choice:
                assert c.text in so.choice
            elif so.grammar:
                tree = ast.parse(c.text, mode="eval")
                assert all(
                    isinstance(n, (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult))
                    for n in ast.walk(tree)
                ), c.text
                eval(compile(tree, "<grammar>", "eval"))
            else:
                assert isinstance(json.loads(c.text), dict)


def test_a_complete_grammar_allows_only_eos_and_max_tokens_inside_one_is_length(llm):
    eos = llm.get_tokenizer().eos_token_id
    out = llm.generate(
        ["Yes or no?"],
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, structured_outputs=SO(choice=["yes", "no"])),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "length" and out.text in ("yes", "no")
    n = out.token_ids.index(eos)  # the grammar ended: from there on only EOS is allowed
    assert out.token_ids[n:] == [eos] * (12 - n) and llm.get_tokenizer().decode(out.token_ids[:n]) == out.text
    out = llm.generate(
        ["JSON:"], SamplingParams(max_tokens=5, temperature=0, structured_outputs=SO(json=SCHEMAS[0])), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "length" and out.text.startswith("{")


def test_other_masks_never_empty_a_constrained_row(llm):
    """min_tokens bans EOS where the grammar allows only EOS: the grammar wins, the output stays valid; a
    request stopped by a stop string drops its matcher."""
    outs = llm.generate(
        ["Yes?", "Sure?"],
        [
            SamplingParams(max_tokens=12, temperature=0, min_tokens=6, structured_outputs=SO(json={"type": "boolean"})),
            SamplingParams(max_tokens=40, temperature=0, stop=["e"], structured_outputs=SO(regex=r"[a-z ]{10,30}")),
        ],
        use_tqdm=False,
    )
    assert json.loads(outs[0].outputs[0].text) in (True, False)
    assert outs[1].outputs[0].finish_reason == "stop" or re.fullmatch(r"[a-z ]{10,30}", outs[1].outputs[0].text)
    assert llm.llm_engine.structured.matchers == {}


def test_unconstrained_requests_unchanged_beside_constrained_ones(llm):
    free = [_chat(llm, "Tell me about the sea."), _chat(llm, "Count to five.")]
    free_params = [SamplingParams(max_tokens=40, temperature=0), SamplingParams(max_tokens=40, temperature=0.8, seed=9)]
    alone = [o.outputs[0].token_ids for o in llm.generate(free, free_params, use_tqdm=False)]
    mixed = llm.generate(
        [free[0], _chat(llm, "JSON please"), free[1], _chat(llm, "A number")],
        [
            free_params[0],
            SamplingParams(max_tokens=60, temperature=0, structured_outputs=SO(json=SCHEMAS[0])),
            free_params[1],
            SamplingParams(max_tokens=10, temperature=0, structured_outputs=SO(regex=r"[0-9]{1,4}")),
        ],
        use_tqdm=False,
    )
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS[0])


def test_constrained_outputs_unchanged_with_speculation(llm):
    """n-gram drafts are cut where the grammar would refuse them; what is emitted does not move."""
    spec = LLM(
        max_model_len=1024,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
        structured_outputs_config=llm.llm_engine.config.structured.structured_outputs_config,
    )
    schema = {
        "type": "array",
        "items": {"type": "object", "properties": {"name": S, "id": INT}, "required": ["name", "id"]},
        "minItems": 3,
        "maxItems": 4,
    }
    prompts = [
        _chat(llm, 'Repeat: [{"name": "ab", "id": 1}, {"name": "ab", "id": 1}, {"name": "ab", "id": 1}]'),
        _chat(llm, "List three users as JSON."),
    ]
    params = [
        SamplingParams(max_tokens=120, temperature=0, structured_outputs=SO(json=schema)),
        SamplingParams(max_tokens=120, temperature=0.7, seed=4, structured_outputs=SO(json=schema)),
    ]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    for o in got:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
    stats = spec.llm_engine.core.make_stats().spec_decode
    assert stats.num_accepted_tokens > 0


def _deep(levels: int) -> dict:
    node: dict = {"type": "integer"}
    for _ in range(levels):
        node = {"type": "array", "items": node}
    return {"json": node}


@pytest.mark.parametrize(
    "so,field",
    [
        (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "structured_outputs.json"),
        (dict(json={"type": "array", "uniqueItems": True}), "structured_outputs.json"),  # not enforceable: refused
        (dict(json="{not json"), "structured_outputs.json"),
        (dict(regex="(ab"), "structured_outputs.regex"),
        (dict(choice=[]), "structured_outputs.choice"),
        (dict(grammar="root ::= ("), "structured_outputs.grammar"),
        (dict(regex="a", choice=["a"]), "structured_outputs"),
        (dict(choice=["x"] * 5000), "structured_outputs.choice"),
        (dict(json="false"), "structured_outputs.json"),  # a boolean schema: refused, not a hang
        (dict(json=True), "structured_outputs.json"),
        (
            dict(
                json={
                    "type": "array",
                    "items": {"type": "array", "items": {"$defs": {"a": [[[[{"type": "integer"}]]]]}}},
                }
                | _deep(70)
            ),
            "structured_outputs.json",
        ),
    ],
)
def test_bad_specs_are_refused_naming_the_field(llm, so, field):
    with pytest.raises(InvalidParameterError) as e:
        llm.generate(["hi"], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
    assert e.value.param == field, str(e.value)
    assert "/project/" not in str(e.value)  # the backend's reason, without its log prefix
    # the engine is unharmed
    assert llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_auto_falls_back_to_guidance_for_what_xgrammar_cannot_enforce():
    llm = LLM(max_model_len=256, structured_outputs_config={"backend": "auto"})
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}},
        "required": ["n"],
    }  # llguidance has multipleOf
    outs = llm.generate(
        ["Numbers:"] * 2,
        [SamplingParams(max_tokens=40, temperature=t, seed=1, structured_outputs=SO(json=schema)) for t in (0, 1.0)],
        use_tqdm=False,
    )
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


def test_a_compile_over_the_timeout_aborts_that_request_only(monkeypatch):
    """compile_timeout bounds how long a request may wait for its grammar; nobody else waits for it."""
    from pagedllm.structured_output import StructuredOutputManager

    real = StructuredOutputManager._compile

    def slow(self, so):  # certainly longer than the timeout: a fast compile done before the first poll is ready
        time.sleep(0.5)
        return real(self, so)

    monkeypatch.setattr(StructuredOutputManager, "_compile", slow)
    llm = LLM(max_model_len=256, structured_outputs_config={"compile_timeout": 0.001})
    schema = {
        "type": "object",
        "properties": {
            f"field_{i}": {"type": "array", "items": {"type": "string", "pattern": f"^[a-z]{{1,{i + 2}}}$"}}
            for i in range(40)
        },
    }
    free = SamplingParams(max_tokens=16, temperature=0)
    want = llm.generate(["Hello"], free, use_tqdm=False)[0].outputs[0].token_ids
    slow, other = llm.generate(
        ["JSON:", "Hello"], [SamplingParams(max_tokens=16, structured_outputs=SO(json=schema)), free], use_tqdm=False
    )
    assert slow.outputs[0].finish_reason == "abort" and slow.outputs[0].token_ids == []
    assert "longer than" in slow.outputs[0].stop_reason  # the reason reaches the client
    assert other.outputs[0].token_ids == want
    assert not llm.llm_engine.core.has_unfinished_requests()


def test_bad_backend_is_refused():
    with pytest.raises(InvalidParameterError) as e:
        LLM(structured_outputs_config={"backend": "outlines"})
    assert e.value.param == "structured_outputs_config.backend"
