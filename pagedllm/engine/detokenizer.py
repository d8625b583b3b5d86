"""Incremental detokenization and stop-string matching.

Decoding token by token would split multi-byte characters and drop the
leading spaces that some tokenizers attach to a word. Instead each step decodes
a short window ``ids[prefix_offset:]`` and emits only the text past what the
window's prefix already produced, and only once it no longer ends in an
incomplete character (U+FFFD). A few prompt tokens seed the window so the first
output token decodes with its proper leading space.
"""

from __future__ import annotations

from typing import Any

_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        # only matters when special tokens are kept in the text
        self.special = (
            set(tokenizer.all_special_ids) if not skip_special_tokens and spaces_between_special_tokens else set()
        )
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        if not self.special or not self.special.intersection(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)
        return decode_with_spaced_specials(self.tokenizer, ids, self.special)

    def step(self, new_token_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the newly completed text (on ``final``, flush whatever is left)."""
        self.ids.extend(new_token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""


def decode_with_spaced_specials(tokenizer: Any, ids: list[int], special: set[int]) -> str:
    """transformers' slow-tokenizer rule: special tokens and the runs between them, joined by spaces."""
    parts: list[str] = []
    run: list[int] = []
    for t in ids:
        if t in special:
            if run:
                parts.append(tokenizer.decode(run, clean_up_tokenization_spaces=False))
                run = []
            parts.append(tokenizer.decode([t], skip_special_tokens=False))
        else:
            run.append(t)
    if run:
        parts.append(tokenizer.decode(run, clean_up_tokenization_spaces=False))
    return " ".join(parts)


def find_stop_string(text: str, new_chars: int, stops: list[str], include: bool) -> tuple[str, int] | None:
    """Search the text's tail (only where a newly added char could complete a stop).

    Returns (stop string, length to cut the text to) or None.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return None
    idx, stop = best
    return stop, idx + len(stop) if include else idx
