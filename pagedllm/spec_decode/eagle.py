"""EAGLE / EAGLE-3 and MEDUSA proposers: draft heads fed with the target's hidden states of this step.

EAGLE's head runs one decoder layer over pairs (token p+1, features at p). Its KV
cache is paged under the target's block tables, like a draft model's, and is kept
level by a catch-up pass over exactly the positions the target computed this step
and kept (prompt chunks, accepted drafts): their target features exist only now.
Position p's entry needs token p+1, known for every kept position (the next prompt
token, or the token just sampled). The catch-up's last row gives the first draft;
k-1 more one-token passes feed the head its own output features, writing into the
lookahead slots the scheduler reserves (overwritten by the next catch-up).

MEDUSA needs no cache: its heads map the target's final hidden state at the last
kept position straight to k guesses.

Drafts are greedy (q one-hot), so verification is "accept while the draft equals the
target's own draw", exact for greedy and sampled requests alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagedllm.spec_decode.proposer import ProposeContext
from pagedllm.worker.batch import Segment, build_batch

if TYPE_CHECKING:
    from pagedllm.models.spec_heads import EagleHead, MedusaHead


def _last_kept_rows(ctx: ProposeContext) -> dict[str, int]:
    """Flat index, in this step's hidden states, of each request's last position the target computed and kept."""
    rows = {}
    for i, rid in enumerate(ctx.scheduled):
        rows[rid] = ctx.offsets[i] + ctx.states[rid].num_computed_tokens - 1 - ctx.starts[i]
    return rows


class EagleProposer:
    def __init__(
        self,
        head: EagleHead,
        kv_caches: list[torch.Tensor],
        num_speculative_tokens: int,
        block_size: int,
        device: torch.device,
        target_logits: Callable[[torch.Tensor], torch.Tensor | None],
    ):
        self.head = head
        self.kv_caches = kv_caches
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.device = device
        self.target_logits = target_logits

    def add(self, req_id: str, num_computed_tokens: int) -> None:
        pass  # no per-request state: every step catches up on exactly what the target computed

    def remove(self, req_id: str) -> None:
        pass

    @torch.inference_mode()
    def propose(self, ctx: ProposeContext) -> dict[str, list[int]]:
        segments: list[Segment] = []
        rows: list[torch.Tensor] = []  # the target's rows feeding each segment
        rids: list[str] = []
        for i, rid in enumerate(ctx.scheduled):
            st = ctx.states[rid]
            start, end = ctx.starts[i], st.num_computed_tokens  # kept positions: [start, end)
            segments.append(
                Segment(st.token_ids[start + 1 : end + 1], start, st.block_ids, split=end - start <= 1 + self.k)
            )
            rows.append(torch.arange(ctx.offsets[i], ctx.offsets[i] + end - start))
            rids.append(rid)
        order = sorted(range(len(segments)), key=lambda j: not segments[j].split)
        segments = [segments[j] for j in order]
        rids = [rids[j] for j in order]
        idx = torch.cat([rows[j] for j in order]).to(self.device)
        features = self.head.target_features(
            ctx.hidden.index_select(0, idx), None if ctx.aux_hidden is None else ctx.aux_hidden.index_select(0, idx)
        )
        batch = build_batch(segments, self.block_size, self.device)
        for_logits, nxt = self.head(batch.input_ids, batch.positions, features, self.kv_caches, batch.meta)
        want = [(j, rid) for j, rid in enumerate(rids) if rid in ctx.want]
        if not want:
            return {}
        last = torch.tensor([batch.offsets[j + 1] - 1 for j, _ in want], device=self.device)
        tokens = self.head.draft_token_ids(for_logits.index_select(0, last), self.target_logits)
        nxt = nxt.index_select(0, last)
        live = [rid for _, rid in want]
        drafts = {rid: [tok] for rid, tok in zip(live, tokens.tolist())}
        for step in range(1, self.k):  # feed the head its own features, one token per pass
            keep = [n for n, rid in enumerate(live) if ctx.want[rid] > step]
            if not keep:
                break
            if len(keep) < len(live):
                sel = torch.tensor(keep, device=self.device)
                tokens, nxt = tokens.index_select(0, sel), nxt.index_select(0, sel)
                live = [live[n] for n in keep]
            segs = [
                Segment(
                    [drafts[rid][-1]],
                    ctx.states[rid].num_computed_tokens + step - 1,
                    ctx.states[rid].block_ids,
                    split=True,
                )
                for rid in live
            ]
            b = build_batch(segs, self.block_size, self.device)
            for_logits, nxt = self.head(b.input_ids, b.positions, nxt, self.kv_caches, b.meta)
            tokens = self.head.draft_token_ids(for_logits, self.target_logits)
            for rid, tok in zip(live, tokens.tolist()):
                drafts[rid].append(tok)
        return drafts


class MedusaProposer:
    def __init__(self, head: MedusaHead, num_speculative_tokens: int):
        self.head = head
        self.k = num_speculative_tokens
        self.kv_caches: list[torch.Tensor] = []

    def add(self, req_id: str, num_computed_tokens: int) -> None:
        pass

    def remove(self, req_id: str) -> None:
        pass

    @torch.inference_mode()
    def propose(self, ctx: ProposeContext) -> dict[str, list[int]]:
        if not ctx.want:
            return {}
        last = _last_kept_rows(ctx)
        rids = list(ctx.want)
        idx = torch.tensor([last[rid] for rid in rids], device=ctx.hidden.device)
        guesses = self.head.draft_token_ids(ctx.hidden.index_select(0, idx), self.k).tolist()
        return {rid: g[: ctx.want[rid]] for rid, g in zip(rids, guesses)}
