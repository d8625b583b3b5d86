"""The interface every proposer implements, and what the runner hands it after each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(slots=True)
class ProposeContext:
    states: dict[str, Any]  # request id -> the runner's _ReqState (token_ids hold the accepted tokens)
    scheduled: list[str]  # this step's requests, in batch order
    sampled: set[str]  # those that got new tokens this step
    want: dict[str, int]  # requests to draft for -> at most this many drafts
    hidden: torch.Tensor  # the target's last hidden states of this step's tokens (flattened batch)
    offsets: list[int]  # flat index of each scheduled request's first token in `hidden`
    starts: list[int]  # position of each scheduled request's first token this step
    aux_hidden: torch.Tensor | None = None  # the target's EAGLE-3 aux states, row for row with `hidden`
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)  # filled by proposers with a q


class Proposer(Protocol):
    kv_caches: list[torch.Tensor]  # the proposer's own paged KV cache (empty when it has none)

    def add(self, req_id: str, num_computed_tokens: int) -> None:
        """A request the runner (re)starts, with this many tokens already in the KV cache (prefix hits)."""

    def remove(self, req_id: str) -> None:
        """A request finished or was preempted."""

    def propose(self, ctx: ProposeContext) -> dict[str, list[int]]:
        """Drafts for the requests in ``ctx.want`` (fewer, or none, is fine). Called after every step that
        ran the model, so a proposer with a KV cache can keep it level with the target's."""
