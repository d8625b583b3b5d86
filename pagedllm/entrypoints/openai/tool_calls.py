"""Tool calling: OpenAI's ``tools`` / ``tool_choice`` turned into grammars and parsed back into ``tool_calls``.

* ``tool_choice`` a named function: the output *is* its arguments, constrained by the function's
  parameter schema (finish_reason ``stop``, as OpenAI).
* ``"required"``: the output is a JSON array of ``{"name", "parameters"}`` objects, one of the tools
  each (a JSON-schema grammar built from every tool's parameters), at least one.
* ``"auto"``: the model answers freely; a parser for its own tool-call format
  (``--tool-call-parser``) lifts the calls out of the text. Registered: ``hermes``
  (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, Qwen 2.5/3, Hermes, SmolLM3)
  and ``llama3_json`` (the whole answer is ``{"name": ..., "parameters": {...}}``, calls separated by
  ``;``, optionally after ``<|python_tag|>``). ``hermes`` also takes the untagged calls small Qwen
  models write instead of the tags their template asks for (see :meth:`ToolParser.untagged_calls`).
  Streamed, every call goes out as it is written (a call's id and name once, then its arguments in pieces):
  ``hermes``' tagged and untagged calls, ``llama3_json``'s, ``required``'s (:func:`required_stream_calls`). An
  untagged call streams once it names an offered tool and its arguments have begun; whether it is a call is
  decided when the answer ends (see :meth:`ToolParser.untagged_stream_calls`).
* ``"none"``: no tools are offered to the model.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagedllm.errors import InvalidParameterError

MAX_TOOLS = 128


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _params_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def forced_schema(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool = True) -> dict[str, Any] | None:
    """The JSON schema the output must follow for ``required`` or a named function; None otherwise.
    ``parallel`` False (``parallel_tool_calls: false``): ``required`` makes exactly one call."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return _params_schema(next(t for t in tools if t["function"]["name"] == name))
    if tool_choice == "required":
        return {
            "type": "array",
            "minItems": 1,
            **({} if parallel else {"maxItems": 1}),
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"name": {"const": t["function"]["name"]}, "parameters": _params_schema(t)},
                        "required": ["name", "parameters"],
                    }
                    for t in tools
                ]
            },
        }
    return None


def parse_forced(text: str, tool_choice: Any) -> list[ParsedCall]:
    """The calls of a ``required`` or named-function answer (its grammar guarantees the shape). A ``required``
    call's arguments are its ``parameters`` as written, which is what streaming sent piece by piece."""
    if isinstance(tool_choice, dict):
        return [ParsedCall(tool_choice["function"]["name"], text)]
    try:
        items = json.loads(text, strict=False)  # a control character the grammar let into a string is kept
    except json.JSONDecodeError:  # cut short by max_tokens
        return []
    if not isinstance(items, list) or not all(isinstance(c, dict) and "name" in c and "parameters" in c for c in items):
        return []
    calls = [ParsedCall(str(c["name"]), json.dumps(c["parameters"], ensure_ascii=False)) for c in items]
    _as_written(calls, required_stream_calls(text))
    return calls


def required_stream_calls(text: str) -> list[tuple[str, str]]:
    """The calls a partial ``required`` answer (a JSON array of ``{"name", "parameters"}`` objects, as its grammar
    writes them) shows so far, as (name, arguments' text so far), each once its name is complete."""
    body = text.lstrip()
    return call_sequence(body, 1, ",") if body.startswith("[") else []


def call_sequence(body: str, pos: int, separators: str, blank_separates: bool = False) -> list[tuple[str, str]]:
    """The call objects written one after another in ``body`` from ``pos`` (between them blanks and
    ``separators``; blanks alone too where ``blank_separates``), as far as they go: (name, arguments' text so far)
    for each whose name is complete; the arguments as written, "" before they begin (or when written as a JSON
    string, which is not their text)."""
    return [
        (scan.name, _escape_controls(scan.arguments or ""))
        for scan in _call_scans(body, pos, separators, blank_separates)
        if scan.name is not None
    ]


def _call_scans(body: str, pos: int, separators: str, blank_separates: bool = False) -> list[CallScan]:
    """:func:`call_sequence`'s calls as their scans (each with its name)."""
    scans: list[CallScan] = []
    while True:
        while pos < len(body) and body[pos] in " \n\t\r":
            pos += 1
        if not body.startswith("{", pos):
            return scans
        scan = scan_call(body[pos:])
        if scan.name is None:
            return scans
        scans.append(scan)
        end = _value_end(body, pos)
        if end is None:
            return scans
        pos = end
        while pos < len(body) and body[pos] in " \n\t\r":
            pos += 1
        if blank_separates and body.startswith("{", pos):
            continue
        if pos >= len(body) or body[pos] not in separators:
            return scans
        pos += 1


def _escape_controls(text: str) -> str:
    """``text`` (JSON, perhaps cut short) with each raw control character inside a string written as its escape,
    which strict JSON needs (a grammar may let one into a string). Character by character, from the start: the
    text of a longer prefix begins with a shorter one's, so streamed pieces still add up."""
    if not any(c < " " for c in text):
        return text
    out, in_string, escaped = [], False, False
    for c in text:
        if in_string and c < " ":
            out.append(json.dumps(c)[1:-1])  # \n, \t, \u0001, ...
            escaped = False
            continue
        out.append(c)
        if escaped:
            escaped = False
        elif c == "\\" and in_string:
            escaped = True
        elif c == '"':
            in_string = not in_string
    return "".join(out)


def _as_written(calls: list[ParsedCall], written: list[tuple[str, str]]) -> None:
    """Each call's arguments as the model wrote them (``written``: :func:`call_sequence` over the whole answer,
    control characters in strings escaped), which is what streaming sent piece by piece: where ``written`` holds
    the same calls and its text is strict JSON."""
    if [name for name, _ in written] != [call.name for call in calls]:
        return
    for call, (_, text) in zip(calls, written):
        if not text:  # written as a JSON string: its text is not the arguments
            continue
        try:
            json.loads(text)
        except json.JSONDecodeError:
            continue
        call.arguments = text


# -- checking the tools' parameter schemas --------------------------------------------------

_JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA = (
    "not",
    "items",
    "additionalItems",
    "additionalProperties",
    "contains",
    "propertyNames",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_STRINGS = ("title", "description", "format", "$ref", "$id", "$schema", "$anchor", "$comment", "pattern")


def schema_problem(schema: Any) -> str | None:
    """Why ``schema`` is not a valid JSON Schema, or None. Checks what JSON Schema's meta-schema says of the
    keywords a tool's parameters use (types, subschemas, counts, ``required``, ``enum``, ``pattern``); other
    keywords pass, as the meta-schema lets them. Walked with a stack: a deep schema cannot exhaust Python's."""
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        s, at = stack.pop()
        where = at.rstrip(".") or "the schema"
        if isinstance(s, bool):  # true / false: any value / no value
            continue
        if not isinstance(s, dict):
            return f"{where} must be a schema (an object or a boolean), got {type(s).__name__}"
        t = s.get("type")
        if t is not None:
            names = t if isinstance(t, list) else [t]
            if not names or any(n not in _JSON_TYPES for n in names) or len(set(map(str, names))) != len(names):
                return f"{at}type must be one of {', '.join(_JSON_TYPES)} (or a list of them), got {t!r}"
        for key in _SUBSCHEMA_MAPS:
            v = s.get(key)
            if v is not None and not isinstance(v, dict):
                return f"{at}{key} must be an object mapping names to schemas"
            stack.extend((sub, f"{at}{key}.{name}.") for name, sub in (v or {}).items())
        for key in _SUBSCHEMA_LISTS:
            v = s.get(key)
            if v is not None and (not isinstance(v, list) or not v):
                return f"{at}{key} must be a non-empty list of schemas"
            stack.extend((sub, f"{at}{key}[{i}].") for i, sub in enumerate(v or []))
        for key in _SUBSCHEMA:
            if key in s:
                v = s[key]
                if key == "items" and isinstance(v, list):  # the tuple form of drafts 4 to 7
                    stack.extend((sub, f"{at}items[{i}].") for i, sub in enumerate(v))
                else:
                    stack.append((v, f"{at}{key}."))
        required = s.get("required")
        if required is not None and (
            not isinstance(required, list)
            or not all(isinstance(r, str) for r in required)
            or len(set(required)) != len(required)
        ):
            return f"{at}required must be a list of distinct property names"
        if "enum" in s and not isinstance(s["enum"], list):
            return f"{at}enum must be a list"
        for key in _COUNTS:
            v = s.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                return f"{at}{key} must be a non-negative integer, got {v!r}"
        for key in _NUMBERS:
            v = s.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                return f"{at}{key} must be a number, got {v!r}"
        if isinstance(s.get("multipleOf"), (int, float)) and s["multipleOf"] <= 0:
            return f"{at}multipleOf must be greater than 0"
        for key in _STRINGS:
            if key in s and not isinstance(s[key], str):
                return f"{at}{key} must be a string"
        if "pattern" in s:
            try:
                re.compile(s["pattern"])
            except (re.error, OverflowError, RecursionError) as e:  # a huge repeat count, thousands of groups
                return f"{at}pattern is not a valid regular expression: {e}"
        if "uniqueItems" in s and not isinstance(s["uniqueItems"], bool):
            return f"{at}uniqueItems must be a boolean"
    return None


def check_tool_schemas(tools: list[dict[str, Any]]) -> None:
    """A 400 naming the first tool (chat's shape) whose ``parameters`` is not a valid JSON Schema of an object.
    Checked for every tool_choice: the schemas reach the chat template and, for ``required`` or a named
    function, the grammar."""
    for i, tool in enumerate(tools):
        params = tool["function"].get("parameters")
        if params is None:
            continue
        problem = schema_problem(params)
        if problem is None and params.get("type", "object") != "object":
            problem = f"a function's parameters are an object: type must be 'object', got {params['type']!r}"
        if problem is not None:
            raise InvalidParameterError(
                f"tools[{i}]: the parameters of function {tool['function']['name']!r} are not a valid JSON "
                f"Schema: {problem}",
                f"tools[{i}].function.parameters",
            )


class ToolParser:
    """Lifts tool calls out of a free answer. ``streamable(text)`` is how much of a partial answer is
    plain content for sure (a call may still begin after it). The server keeps one, unbound; each request
    gets a copy bound to the tools it offers (:meth:`for_tools`)."""

    name = ""

    def __init__(self, tools: list[dict[str, Any]] | None = None):
        self.tools = {t["function"]["name"]: t["function"] for t in tools or ()}

    def for_tools(self, tools: list[dict[str, Any]]) -> ToolParser:
        return type(self)(tools)

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        raise NotImplementedError

    def streamable(self, text: str) -> int:
        raise NotImplementedError

    def stream_calls(self, text: str) -> list[tuple[str, str]]:
        """The calls a partial answer shows so far, as (name, arguments' text so far), for streaming them as
        they are written; a parser whose calls go out whole at the end returns none."""
        return []

    # -- calls written without the model's own format ------------------------------------------------------------
    def untagged_calls(self, text: str) -> tuple[str | None, list[ParsedCall]] | None:
        """(content, calls) when the answer is, instead of the model's format, tool calls written as plain JSON:
        the whole answer one or more ``{"name": ..., "arguments": {...}}`` objects (or a list of them, or
        ``parameters`` for ``arguments``), bare or in one ```json fence at its end (the text before the fence is
        the content). Qwen2.5-Coder 0.5B and 1.5B answer so although their template asks for ``<tool_call>``
        tags. Each object must be a call and nothing more: a name of an offered tool and arguments valid against
        its ``parameters`` schema, so an ordinary JSON answer is never taken for a call. None otherwise."""
        if not self.tools:
            return None
        body, content = text.strip(), None
        if body.endswith("```") and len(body) > 6:
            opener = body.rfind("```", 0, len(body) - 3)
            head = body[opener + 3 : len(body) - 3] if opener >= 0 else ""
            info, _, inner = head.partition("\n")
            if opener < 0 or info.strip() not in ("", "json"):
                return None
            content, body = body[:opener].strip() or None, inner.strip()
        if not body.startswith(("{", "[")):
            return None
        values = _json_values(body)
        if values is None:
            return None
        calls = [self._checked_call(v) for item in values for v in (item if isinstance(item, list) else [item])]
        if not calls or any(c is None for c in calls):
            return None
        found = [c for c in calls if c is not None]
        _as_written(found, self.untagged_stream_calls(text))  # what streaming sent piece by piece
        return content, found

    def _checked_call(self, value: Any) -> ParsedCall | None:
        if not isinstance(value, dict) or len(value) != 2 or not isinstance(value.get("name"), str):
            return None
        args = value.get("arguments", value.get("parameters"))
        tool = self.tools.get(value["name"])
        if tool is None or not isinstance(args, dict):
            return None
        import jsonschema

        schema = tool.get("parameters") or {"type": "object"}
        try:
            if not jsonschema.validators.validator_for(schema)(schema).is_valid(args):
                return None
        except Exception:  # a schema jsonschema cannot apply (a $ref it cannot resolve, ...)
            return None  # is not one we can vouch for a call by
        return ParsedCall(value["name"], json.dumps(args, ensure_ascii=False))

    def untagged_stream_calls(self, text: str) -> list[tuple[str, str]]:
        """The untagged calls (:meth:`untagged_calls`) a partial answer shows being written, as (name, arguments'
        text so far): each once it names an offered tool and its arguments object has begun, a call's shape and no
        ordinary JSON answer's. Whether they are calls is decided when the answer ends (the arguments must
        validate, nothing may follow them); a stream that sent one that is not also gets the text as content, as
        it does a tagged call whose JSON turns out malformed."""
        hold = self.untagged_hold(text)
        if hold is None:
            return []
        body = text[hold:]
        if body.startswith("`"):  # a ```json fence: the calls begin after its first line
            _, newline, body = body.partition("\n")
            if not newline:
                return []
        body = body.lstrip()
        bracket = body.startswith("[")
        calls = []
        for scan in _call_scans(body, 1, ",") if bracket else _call_scans(body, 0, ";", blank_separates=True):
            if scan.name is None or scan.name not in self.tools or scan.arguments is None or len(set(scan.keys)) > 2:
                break
            calls.append((scan.name, _escape_controls(scan.arguments)))
        return calls

    def untagged_hold(self, text: str) -> int | None:
        """Where, in a partial answer, untagged calls (:meth:`untagged_calls`) may have begun: the answer's
        opening ``{`` or ``[``, or a ```json fence (or the backticks that may start one); None when none can."""
        if not self.tools:
            return None
        stripped = text.lstrip()
        if not stripped:
            return 0  # nothing but blanks yet: held, in case a call follows
        if stripped[0] in "{[":
            return len(text) - len(stripped)
        at = text.find("`")
        while at >= 0:
            run = len(text[at:]) - len(text[at:].lstrip("`"))
            rest = text[at + run :]
            if run < 3 and not rest:
                return at  # "`" or "``" at the end: maybe the start of a fence
            if run == 3:
                info, newline, inner = rest.partition("\n")
                if not newline and "json".startswith(info.strip()):
                    return at  # the fence's info string, still being written
                if newline and info.strip() in ("", "json") and (not inner.strip() or inner.lstrip()[0] in "{["):
                    return at
            at = text.find("`", at + run)
        return None


def _json_values(body: str) -> list[Any] | None:
    """The JSON values ``body`` holds one after another (separated by blanks or ``;``), or None if any is not
    JSON."""
    decoder, pos, values = json.JSONDecoder(), 0, []
    while pos < len(body):
        try:
            value, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return None
        values.append(value)
        while pos < len(body) and body[pos] in "; \n\t\r":
            pos += 1
    return values


def _string_end(s: str, i: int) -> int | None:
    """The end of the JSON string that opens at ``s[i]`` (a quote), or None if ``s`` ends inside it."""
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
        elif s[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def _value_end(s: str, i: int) -> int | None:
    """The end of the JSON value that begins at ``s[i]``, or None if ``s`` ends inside it (not validated: the
    whole text is parsed by json once complete)."""
    if s[i] == '"':
        return _string_end(s, i)
    if s[i] in "{[":
        depth, j = 0, i
        while j < len(s):
            c = s[j]
            if c == '"':
                end = _string_end(s, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}] \n\t\r":
        j += 1
    return j if j < len(s) else None  # a number or literal may still grow


@dataclass(frozen=True, slots=True)
class CallScan:
    """What a call object written so far (``{"name": ..., "arguments": {...}}``, perhaps cut short) shows."""

    name: str | None  # the name, once its string is complete
    arguments: str | None  # the arguments object's text so far, as written (None before it starts)
    complete: bool  # the arguments object is closed
    keys: tuple[str, ...] = ()  # the keys read, in order


def scan_call(body: str) -> CallScan:
    """Reads a call object's keys as far as ``body`` goes, without needing it to be complete."""
    name = args = None
    complete = False
    keys: list[str] = []
    i = len(body) - len(body.lstrip())
    if not body[i:].startswith("{"):
        return CallScan(None, None, False)
    i += 1
    while True:
        i += len(body[i:]) - len(body[i:].lstrip())
        if i >= len(body) or body[i] != '"':
            break
        key_end = _string_end(body, i)
        if key_end is None:
            break
        key = json.loads(body[i:key_end])
        keys.append(key)
        i = key_end + len(body[key_end:]) - len(body[key_end:].lstrip())
        if not body[i:].startswith(":"):
            break
        i += 1
        i += len(body[i:]) - len(body[i:].lstrip())
        if i >= len(body):
            break
        end = _value_end(body, i)
        if key == "name" and end is not None and body[i] == '"':
            name = json.loads(body[i:end])
        elif key in ("arguments", "parameters") and body[i] == "{":
            args, complete = body[i : end if end is not None else len(body)], end is not None
        if end is None:
            break
        i = end + len(body[end:]) - len(body[end:].lstrip())
        if not body[i:].startswith(","):
            break
        i += 1
    return CallScan(name, args, complete, tuple(keys))


def _call(obj: Any) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments already as JSON text
        try:
            json.loads(args)
        except json.JSONDecodeError:
            return None
        return ParsedCall(obj["name"], args)
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesToolParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        if self.OPEN not in text:
            return self.untagged_calls(text) or (text, [])
        calls = []
        for body in self._BLOCK.findall(text):
            try:
                call = _call(json.loads(body.strip()))
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a well-formed call: leave the text as it is
                return text, []
            scan = scan_call(body)
            if scan.complete and scan.arguments is not None:  # the arguments as the model wrote them, which is
                call.arguments = scan.arguments  # what streaming sent piece by piece
            calls.append(call)
        content = text[: text.index(self.OPEN)].strip()
        return content or None, calls

    def stream_calls(self, text: str) -> list[tuple[str, str]]:
        """The tagged calls of a partial answer so far, each (name, its arguments' text so far) once the name
        is complete: a call streams as it is written. Without a tag, the untagged calls
        (:meth:`~ToolParser.untagged_stream_calls`)."""
        if self.OPEN not in text:
            return self.untagged_stream_calls(text)
        calls = []
        for body in self._BLOCK.findall(text):
            scan = scan_call(body)
            if scan.name is None:
                break
            calls.append((scan.name, scan.arguments or ""))
        return calls

    def streamable(self, text: str) -> int:
        at = text.find(self.OPEN)
        if at >= 0:
            return at
        hold = self.untagged_hold(text)
        if hold is not None:
            return hold
        for k in range(min(len(self.OPEN) - 1, len(text)), 0, -1):  # hold back a possible start of the tag
            if self.OPEN.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls = [_call(obj) for obj in _json_values(body) or [None]]
        if any(c is None for c in calls):
            return text, []
        found = [c for c in calls if c is not None]
        _as_written(found, call_sequence(body, 0, ";"))  # what streaming sent piece by piece
        return None, found

    def stream_calls(self, text: str) -> list[tuple[str, str]]:
        """The calls of a partial answer so far (after ``<|python_tag|>``, if any; separated by ``;``), each
        (name, its arguments' text so far) once the name is complete: a call streams as it is written."""
        body = text.lstrip().removeprefix(self.TAG).lstrip()
        return call_sequence(body, 0, ";")

    def streamable(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith(("{", self.TAG)) or self.TAG.startswith(stripped):
            return 0  # may be a call: hold everything until the end
        return len(text)


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}
