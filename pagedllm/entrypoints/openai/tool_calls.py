"""Tool calling: OpenAI's ``tools`` / ``tool_choice`` turned into grammars and parsed back into ``tool_calls``.

* ``tool_choice`` a named function: the output *is* its arguments, constrained by the function's
  parameter schema (finish_reason ``stop``, as OpenAI).
* ``"required"``: the output is a JSON array of ``{"name", "parameters"}`` objects, one of the tools
  each (a JSON-schema grammar built from every tool's parameters), at least one.
* ``"auto"``: the model answers freely; a parser for its own tool-call format
  (``--tool-call-parser``) lifts the calls out of the text. Registered: ``hermes``
  (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, Qwen 2.5/3, Hermes, SmolLM3)
  and ``llama3_json`` (the whole answer is ``{"name": ..., "parameters": {...}}``, calls separated by
  ``;``, optionally after ``<|python_tag|>``).
* ``"none"``: no tools are offered to the model.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

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


def forced_schema(tools: list[dict[str, Any]], tool_choice: Any) -> dict[str, Any] | None:
    """The JSON schema the output must follow for ``required`` or a named function; None otherwise."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return _params_schema(next(t for t in tools if t["function"]["name"] == name))
    if tool_choice == "required":
        return {
            "type": "array",
            "minItems": 1,
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
    """The calls of a ``required`` or named-function answer (its grammar guarantees the shape)."""
    if isinstance(tool_choice, dict):
        return [ParsedCall(tool_choice["function"]["name"], text)]
    try:
        items = json.loads(text)
    except json.JSONDecodeError:  # cut short by max_tokens
        return []
    if not isinstance(items, list) or not all(isinstance(c, dict) and "name" in c and "parameters" in c for c in items):
        return []
    return [ParsedCall(str(c["name"]), json.dumps(c["parameters"], ensure_ascii=False)) for c in items]


class ToolParser:
    """Lifts tool calls out of a free answer. ``streamable(text)`` is how much of a partial answer is
    plain content for sure (a call may still begin after it)."""

    name = ""

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        raise NotImplementedError

    def streamable(self, text: str) -> int:
        raise NotImplementedError


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
            return text, []
        calls = []
        for body in self._BLOCK.findall(text):
            try:
                call = _call(json.loads(body.strip()))
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a well-formed call: leave the text as it is
                return text, []
            calls.append(call)
        content = text[: text.index(self.OPEN)].strip()
        return content or None, calls

    def streamable(self, text: str) -> int:
        at = text.find(self.OPEN)
        if at >= 0:
            return at
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
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = _call(obj)
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in "; \n\t":
                pos += 1
        return None, calls

    def streamable(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith(("{", self.TAG)) or self.TAG.startswith(stripped):
            return 0  # may be a call: hold everything until the end
        return len(text)


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}
