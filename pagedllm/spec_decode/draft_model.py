"""Draft-model proposer: a smaller model with the target's vocabulary (or the target's own weights,
quantized) proposes k tokens greedily, batched across requests.

It keeps its own paged KV cache, indexed by the target's block tables: every
token the target computes, the draft computes in the same step (prompt chunks,
accepted drafts and the newly sampled token), so prefix-cache hits, n>1 block
copies and preemption need nothing of their own. Its drafts past the accepted
tokens go into lookahead slots the scheduler reserves for it; a rejected draft's
KV is simply overwritten later; an accepted one's KV is already right (same token,
same position, same prefix), so the next catch-up starts after the accepted drafts
it fed itself. Per step it runs one catch-up pass (the tokens it has not seen: a
prompt chunk, or typically just the token the target sampled) and k-1 one-token
passes.

Drafts are greedy, so q is one-hot: the rejection sampler's exact rule is then
"accept while the draft equals the target's own draw", and seeded requests give
the same tokens with or without speculation.

With ``ngram_first`` a prompt lookup (:class:`NgramProposer`) drafts first: a request
whose context holds a match takes its continuation and sits out the draft model's
passes this step; its draft KV stays behind and catches up in one pass (a prompt
chunk's) when the model next drafts for it. A lookup draft whose first token was
rejected hands the next step to the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedllm.spec_decode.proposer import ProposeContext
from pagedllm.worker.batch import Segment, build_batch

if TYPE_CHECKING:
    from pagedllm.models.llama import LlamaForCausalLM
    from pagedllm.spec_decode.ngram import NgramProposer


class DraftModelProposer:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        num_speculative_tokens: int,
        block_size: int,
        device: torch.device,
        ngram: NgramProposer | None = None,
    ):
        self.model = model
        self.ngram = ngram  # ngram_first: the lookup that drafts before the model
        self.looked_up: dict[str, tuple[int, int]] = {}  # a lookup draft's (position, first token), to judge it
        self.kv_caches = kv_caches
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.device = device
        self.computed: dict[str, int] = {}  # tokens of each request whose draft KV is in the cache
        self.fed: dict[str, tuple[int, list[int]]] = {}  # drafts written past `computed`: (first position, ids)

    def add(self, req_id: str, num_computed_tokens: int) -> None:
        self.computed[req_id] = num_computed_tokens
        self.looked_up.pop(req_id, None)
        if self.ngram is not None:
            self.ngram.add(req_id, num_computed_tokens)

    def remove(self, req_id: str) -> None:
        self.computed.pop(req_id, None)
        self.fed.pop(req_id, None)
        self.looked_up.pop(req_id, None)
        if self.ngram is not None:
            self.ngram.remove(req_id)

    def _lookup(self, ctx: ProposeContext) -> dict[str, list[int]]:
        """ngram_first: the prompt lookup's drafts, for the requests it serves this step."""
        assert self.ngram is not None, "called with ngram_first only"
        want = {}
        for rid, k in ctx.want.items():
            last = self.looked_up.pop(rid, None)
            tokens = ctx.states[rid].token_ids
            if last is not None and len(tokens) > last[0] and tokens[last[0]] != last[1]:
                continue  # its last lookup draft lost its first token: the model drafts this step
            want[rid] = k
        if not want:
            return {}
        found = self.ngram.propose(ProposeContext(ctx.states, ctx.scheduled, ctx.sampled, want, ctx.hidden, [], []))
        for rid, d in found.items():
            self.looked_up[rid] = (len(ctx.states[rid].token_ids), d[0])
        return found

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.compute_logits(hidden)
        assert logits is not None  # the draft runs whole in the driver's process: it holds the full vocabulary
        return logits

    @torch.inference_mode()
    def propose(self, ctx: ProposeContext) -> dict[str, list[int]]:
        looked = self._lookup(ctx) if self.ngram is not None else {}
        # 1. catch up with everything the target now knows: this step's prompt chunks, the accepted drafts and
        #    the token just sampled (its KV goes into the first lookahead slot); a request the lookup drafts
        #    for catches up later
        segments: list[Segment] = []
        rids: list[str] = []
        for rid in ctx.scheduled:
            if rid in looked:
                continue
            st = ctx.states[rid]
            end = len(st.token_ids) if rid in ctx.sampled else st.num_computed_tokens
            start = self.computed[rid]
            pos, fed = self.fed.pop(rid, (0, []))
            if pos == start:  # the drafts the target accepted already have their KV here
                while fed and start < end and st.token_ids[start] == fed[0]:
                    start += 1
                    fed = fed[1:]
            if end > start:
                segments.append(Segment(st.token_ids[start:end], start, st.block_ids, split=end - start <= 1 + self.k))
                rids.append(rid)
            self.computed[rid] = max(start, end)
        if not segments:
            return looked
        order = sorted(range(len(segments)), key=lambda i: not segments[i].split)
        segments = [segments[i] for i in order]
        rids = [rids[i] for i in order]
        batch = build_batch(segments, self.block_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        want = [(i, rid) for i, rid in enumerate(rids) if rid in ctx.want]
        if not want:
            return looked
        idx = torch.tensor([batch.offsets[i + 1] - 1 for i, _ in want], device=self.device)
        last = self._logits(hidden.index_select(0, idx)).argmax(dim=-1).tolist()
        drafts = {rid: [tok] for (_, rid), tok in zip(want, last)}
        # 2. k-1 more greedy steps, one token each, for the requests that want them; these write past the
        #    accepted tokens, into the lookahead slots, and are not counted as computed
        for step in range(1, self.k):
            live = [rid for _, rid in want if ctx.want[rid] > step]
            if not live:
                break
            segs = [
                Segment(
                    [drafts[rid][-1]], len(ctx.states[rid].token_ids) + step - 1, ctx.states[rid].block_ids, split=True
                )
                for rid in live
            ]
            b = build_batch(segs, self.block_size, self.device)
            h = self.model(b.input_ids, b.positions, self.kv_caches, b.meta)
            for rid, tok in zip(live, self._logits(h).argmax(dim=-1).tolist()):
                drafts[rid].append(tok)
        for rid, d in drafts.items():
            self.fed[rid] = (len(ctx.states[rid].token_ids), d[:-1])
        return {**drafts, **looked}
