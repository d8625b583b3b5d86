"""The xgrammar backend: grammars from specs, compiled against the model's vocabulary; matchers and bitmasks."""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from pagedllm.errors import InvalidParameterError


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
        self.vocab_size = vocab_size

    def grammar(self, so: Any) -> Any:
        xgr = self.xgr
        kind = so.kind
        if kind == "json":
            unsupported = _unenforced_keywords(so.json)
            if unsupported:
                raise InvalidParameterError(
                    f"structured_outputs.json: the schema uses {', '.join(sorted(unsupported))}, which the xgrammar "
                    "backend cannot enforce",
                    "structured_outputs.json",
                )
        try:
            if kind == "json":
                return xgr.Grammar.from_json_schema(json.dumps(so.json), any_whitespace=False)
            if kind == "json_object":  # any JSON object (not any value), compact as the schemas are
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return xgr.Grammar.from_regex(so.regex)
            if kind == "choice":
                return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_literal(c) for c in so.choice))
            return xgr.Grammar.from_ebnf(so.grammar)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own errors, with the reason
            reason = [_LOG_PREFIX.sub("", line) for line in str(e).strip().splitlines()]
            raise InvalidParameterError(
                f"structured_outputs.{kind}: {' '.join(reason)[:500] or type(e).__name__}", f"structured_outputs.{kind}"
            ) from None

    def compile(self, grammar: Any) -> Any:
        return self.compiler.compile_grammar(grammar)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)  # rollback is unlimited in xgrammar >= 0.2

    def allocate(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill_row(self, matcher: Any, mask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(mask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def terminated(self, matcher: Any) -> bool:
        return matcher.is_terminated()

    def rollback(self, matcher: Any, num_tokens: int) -> None:
        matcher.rollback(num_tokens)

    def valid_prefix(self, matcher: Any, drafts: list[int]) -> int:
        n = 0
        for tok in drafts:
            if matcher.is_terminated() or not matcher.accept_token(tok):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return n


def _ebnf_literal(text: str) -> str:
    """A double-quoted EBNF string literal (JSON's escapes are the dialect's)."""
    return json.dumps(text, ensure_ascii=False)


_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[hh:mm:ss] file.cc:line: " before the reason

# JSON-schema keywords xgrammar accepts but does not enforce: refused, so no output silently breaks them
_UNENFORCED = {
    "multipleOf",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "propertyNames",
    "patternProperties",
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "unevaluatedProperties",
    "unevaluatedItems",
}


def _unenforced_keywords(schema: Any) -> set[str]:
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found |= _UNENFORCED & node.keys()
            for key, value in node.items():
                if key in ("properties", "$defs", "definitions"):
                    if isinstance(value, dict):
                        stack.extend(value.values())
                elif key not in ("enum", "const", "default", "examples"):
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    return found
