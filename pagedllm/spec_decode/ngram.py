"""N-gram (prompt lookup) proposer: if the last n tokens occurred before, propose what followed them.

Each request keeps its tokens in a growing numpy buffer (appended, never rebuilt),
and a lookup is vectorised: one comparison of the whole context against the last
token, then each candidate is extended leftwards in bulk while it still matches.
The longest match (up to ``prompt_lookup_max``, at least ``prompt_lookup_min``)
wins; among equally long ones the most recent, which is what a copy-heavy answer
is quoting now.
"""

from __future__ import annotations

import numpy as np

from pagedllm.spec_decode.proposer import ProposeContext


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        self.kv_caches: list = []
        self._buffers: dict[str, tuple[np.ndarray, int]] = {}

    def add(self, req_id: str, num_computed_tokens: int) -> None:
        self._buffers.pop(req_id, None)

    def remove(self, req_id: str) -> None:
        self._buffers.pop(req_id, None)

    def propose(self, ctx: ProposeContext) -> dict[str, list[int]]:
        out = {}
        for rid, k in ctx.want.items():
            arr = self._tokens(rid, ctx.states[rid].token_ids)
            drafts = find_continuation(arr, self.n_min, self.n_max, min(k, self.k))
            if drafts:
                out[rid] = drafts
        return out

    def _tokens(self, rid: str, token_ids: list[int]) -> np.ndarray:
        buf, n = self._buffers.get(rid, (None, 0))
        if buf is None or len(buf) < len(token_ids):
            grown = np.empty(max(64, 2 * len(token_ids)), dtype=np.int64)
            if buf is not None:
                grown[:n] = buf[:n]
            buf = grown
        buf[n : len(token_ids)] = token_ids[n:]
        self._buffers[rid] = (buf, len(token_ids))
        return buf[: len(token_ids)]


def find_continuation(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix n-gram."""
    length = len(tokens)
    if length < 2:
        return []
    cand = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # ends of 1-gram matches
    n = 1
    while n < n_max and cand.size:
        ext = cand[cand >= n]
        ext = ext[tokens[ext - n] == tokens[length - 1 - n]]
        if not ext.size:
            break
        cand, n = ext, n + 1
    if n < n_min or not cand.size:
        return []
    i = int(cand[-1])
    return tokens[i + 1 : min(i + 1 + k, length)].tolist()
