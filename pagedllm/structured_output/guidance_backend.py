"""The llguidance backend: the same specs as xgrammar's, compiled lazily by llguidance's matcher."""

from __future__ import annotations

import json
from typing import Any

import torch

from pagedllm.errors import InvalidParameterError


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids)
        self.vocab_size = vocab_size

    def grammar(self, so: Any) -> str:
        ll, kind = self.ll, so.kind
        try:
            if kind == "json":
                text = ll.LLMatcher.grammar_from_json_schema(
                    json.dumps(_strict(so.json)), defaults={"whitespace_flexible": False}
                )
            elif kind == "json_object":
                text = ll.LLMatcher.grammar_from_json_schema(
                    '{"type": "object"}', defaults={"whitespace_flexible": False}
                )
            elif kind == "regex":
                text = ll.LLMatcher.grammar_from_regex(so.regex)
            elif kind == "choice":
                text = ll.grammar_from("choice", json.dumps(so.choice))
            else:
                text = ll.grammar_from("gbnf", so.grammar)
            error = ll.LLMatcher.validate_grammar(text, self.tokenizer)
        except (ValueError, TypeError, RuntimeError) as e:
            error = str(e)
        if error:
            reason = " ".join(line.strip() for line in str(error).strip().splitlines() if line.strip())
            raise InvalidParameterError(f"structured_outputs.{kind}: {reason[:500]}", f"structured_outputs.{kind}")
        return text

    def compile(self, grammar: str) -> Any:
        """A matcher with its lexer built (llguidance builds it lazily, at the first mask): off the engine loop."""
        matcher = self.ll.LLMatcher(self.tokenizer, grammar)
        self.fill_row(matcher, self.allocate(1), 0)
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def allocate(self, rows: int) -> torch.Tensor:
        return self.ll.torch.allocate_token_bitmask(rows, self.vocab_size)

    def fill_row(self, matcher: Any, mask: torch.Tensor, row: int) -> None:
        self.ll.torch.fill_next_token_bitmask(matcher, mask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def terminated(self, matcher: Any) -> bool:
        return matcher.is_stopped()

    def rollback(self, matcher: Any, num_tokens: int) -> None:
        matcher.rollback(num_tokens)

    def valid_prefix(self, matcher: Any, drafts: list[int]) -> int:
        return 0 if matcher.is_stopped() else matcher.validate_tokens(drafts)


def _strict(schema: Any) -> Any:
    """Objects without an ``additionalProperties`` take only the properties they name: xgrammar's strict mode,
    so both backends read a schema alike (and a small model cannot wander off into invented keys)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: (
            v
            if k in ("enum", "const", "default", "examples")
            else {n: _strict(s) for n, s in v.items()}
            if k in ("properties", "$defs", "definitions") and isinstance(v, dict)
            else _strict(v)
        )
        for k, v in schema.items()
    }
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
