"""Batched sampling over one engine step.

Order of operations (as in ../shared/design.md): raw logprobs are taken first
(``logprobs`` report the model's raw distribution, vLLM's default
``raw_logprobs`` mode); then penalties (repetition, frequency, presence) →
logit bias / allowed tokens / bad words → user logits processors → the
structured-output grammar's bitmask → min_tokens masking → temperature →
top-k → top-p → min-p → sample. Greedy rows take the argmax after penalties and
masks, before temperature.

Random rows sample by inverting the distribution's cumulative sum (float64) at one
uniform draw from a generator seeded by (request seed, output position). The draw
for a token therefore depends only on the request's own seed and how many
tokens it has produced: never on batch composition, arrival order or
preemption. (One uniform a row, not one exponential a vocabulary entry: the
exponential race this replaced drew 152k numbers a row serially, 2.5 ms a row on
a 152k vocabulary, a third of a served 1.5B model's decode step at 8 streams.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_MASK = float("-inf")
_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) over the seed space
_DRAW_ROWS = 32  # rows a float64 cumulative sum covers at once: 39 MB at a 152k vocabulary
_DRAW_SALT = 0x5A3D1E  # the stream of a position's token draw (rejection.py salts its acceptance draws apart)


@dataclass(slots=True)
class SamplingBatch:
    temperature: torch.Tensor  # [B] float; 0 for greedy rows
    top_k: torch.Tensor  # [B] long; 0 = off
    top_p: torch.Tensor  # [B] float; 1 = off
    min_p: torch.Tensor  # [B] float; 0 = off
    seeds: list[int]  # [B] per-row seed
    positions: list[int]  # [B] number of tokens the row has generated so far
    stop_masks: list[list[int] | None]  # token ids to forbid (min_tokens not reached), per row
    num_logprobs: list[int | None]  # per row: how many top logprobs to return
    all_greedy: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    penalties: Penalties | None = None
    bias: torch.Tensor | None = None  # [B, V] added to the logits (-inf bans a token)
    grammar_bitmask: torch.Tensor | None = None  # [B, ceil(V / 32)] int32: bit t of a row allows token t
    processed_logprobs: bool = False  # logprobs of the processed distribution instead of the raw one
    # rows with user logits processors: (row, their SamplingParams, prompt ids, output ids)
    user_processors: list[tuple[int, Any, list[int], list[int]]] | None = None
    want_probs: bool = False  # keep the processed probabilities (the rejection sampler reads them)


@dataclass(slots=True)
class Penalties:
    presence: torch.Tensor  # [B]
    frequency: torch.Tensor  # [B]
    repetition: torch.Tensor  # [B]
    output_counts: torch.Tensor  # [B, V] occurrences of each token in the output so far
    prompt_mask: torch.Tensor  # [B, V] bool: token occurs in the prompt


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B]
    logprob_token_ids: torch.Tensor | None = None  # [B, 1 + max_n]: sampled token first, then top-N
    logprobs: torch.Tensor | None = None  # [B, 1 + max_n]
    sampled_ranks: torch.Tensor | None = None  # [B]
    probs: torch.Tensor | None = None  # [B, V] processed distribution (want_probs; greedy rows one-hot)
    lp_source: torch.Tensor | None = None  # [B, V] the log-distribution logprobs are read from
    failed: list[int] | None = None  # rows with no valid token: outside the vocabulary, or masked / not finite


def uniform(seed: int, position: int, salt: int) -> float:
    """A U[0, 1) draw (53 bits) of its own stream per (seed, position, salt)."""
    gen = torch.Generator()
    gen.manual_seed(((seed * _MIX) ^ (position * 0x2545F4914F6CDD1D) ^ salt) & ((1 << 63) - 1))
    return torch.rand((), dtype=torch.float64, generator=gen).item()


def draw(weights: torch.Tensor, seeds: list[int], positions: list[int]) -> torch.Tensor:
    """One index a row of ``weights`` [B, V] (non-negative, any positive total), row i with probability
    proportional to its weights: the first index whose float64 cumulative sum exceeds u * total, u the
    uniform of (seeds[i], positions[i]). A row's index depends on its own weights and draw only."""
    u = torch.tensor([uniform(s, p, _DRAW_SALT) for s, p in zip(seeds, positions, strict=True)], dtype=torch.float64)
    u = u.to(weights.device)
    out = torch.empty(weights.shape[0], dtype=torch.long, device=weights.device)
    for i in range(0, weights.shape[0], _DRAW_ROWS):  # the float64 sums of a few rows at a time
        cdf = torch.cumsum(weights[i : i + _DRAW_ROWS], dim=-1, dtype=torch.float64)
        total = cdf[:, -1:].contiguous()
        idx = torch.searchsorted(cdf, u[i : i + _DRAW_ROWS].unsqueeze(1) * total, right=True).squeeze(1)
        # u * total can round up to the total itself: then the first index that reaches it (one with weight)
        out[i : i + _DRAW_ROWS] = torch.where(
            idx < cdf.shape[1], idx, torch.searchsorted(cdf, total, right=False).squeeze(1)
        )
    return out


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        entry = None  # the logits before any mask, kept only where _grammar_wins may need them
        if batch.grammar_bitmask is not None and (  # only another mask can leave a constrained row no token
            batch.bias is not None or batch.user_processors or any(batch.stop_masks)
        ):
            entry = logits.clone()
        want_lp = any(n is not None for n in batch.num_logprobs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_lp and not batch.processed_logprobs else None
        if batch.penalties is not None:
            logits = apply_penalties(logits, batch.penalties)
        if batch.bias is not None:
            logits = logits + batch.bias
        if batch.user_processors:
            from pagedllm.sampling_params import apply_logits_processors

            for row, params, prompt_ids, output_ids in batch.user_processors:
                logits[row] = apply_logits_processors(params, prompt_ids, output_ids, logits[row])
        if batch.grammar_bitmask is not None:
            logits = apply_token_bitmask(logits, batch.grammar_bitmask)
        for i, mask in enumerate(batch.stop_masks):
            if mask:
                logits[i, mask] = _MASK
        if entry is not None and batch.grammar_bitmask is not None:  # (entry is kept only under a bitmask)
            logits = _grammar_wins(logits, entry, batch.grammar_bitmask)
        processed = probs = None
        if batch.all_greedy:
            tokens = logits.argmax(dim=-1)
            if want_lp and batch.processed_logprobs:
                processed = torch.log_softmax(logits, dim=-1)
        else:
            tokens, processed, probs = self._sample(
                logits, batch, want_lp and batch.processed_logprobs, batch.want_probs
            )
        out = SamplerOutput(tokens, failed=_failed_rows(logits, tokens))
        if batch.want_probs:
            onehot = torch.zeros_like(logits).scatter_(1, tokens.unsqueeze(1), 1.0)
            out.probs = onehot if probs is None else torch.where((batch.temperature == 0).unsqueeze(1), onehot, probs)
        if want_lp:
            out.lp_source = lp_source = processed if batch.processed_logprobs else raw_logprobs
            assert lp_source is not None  # each mode computed its own above
            self.gather_logprobs(lp_source, tokens, batch.num_logprobs, out)
        return out

    def _sample(
        self, logits: torch.Tensor, batch: SamplingBatch, want_processed: bool, want_probs: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(tokens, processed logprobs if asked, the distribution sampled from if asked)."""
        greedy_rows = batch.temperature == 0
        greedy_tokens = logits.argmax(dim=-1)
        greedy_lp = torch.log_softmax(logits, dim=-1) if want_processed else None
        temp = torch.where(greedy_rows, torch.ones_like(batch.temperature), batch.temperature)
        logits = logits / temp.unsqueeze(1)
        if not (batch.no_top_k and batch.no_top_p):
            logits = apply_top_k_top_p(
                logits, None if batch.no_top_k else batch.top_k, None if batch.no_top_p else batch.top_p
            )
        probs = torch.softmax(logits, dim=-1)
        if not batch.no_min_p:
            top = probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < batch.min_p.unsqueeze(1) * top, 0.0)
        sampled = draw(probs, batch.seeds, batch.positions)
        dist = processed = None
        if want_processed or want_probs:  # the distribution actually sampled from, renormalised after min-p
            dist = probs / probs.sum(dim=-1, keepdim=True)
        if want_processed:
            assert greedy_lp is not None and dist is not None
            processed = torch.where(greedy_rows.unsqueeze(1), greedy_lp, torch.log(dist))
        return torch.where(greedy_rows, greedy_tokens, sampled), processed, dist

    @staticmethod
    def gather_logprobs(
        raw: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None], out: SamplerOutput
    ) -> None:
        """The logprob of each row's token (and its rank) and the top-N, from ``raw`` [B, V]."""
        max_n = max(n or 0 for n in num_logprobs)
        sampled_lp = raw.gather(1, tokens.unsqueeze(1))
        out.sampled_ranks = (raw > sampled_lp).sum(dim=-1) + 1
        if max_n:
            top_lp, top_ids = raw.topk(max_n, dim=-1)
            out.logprob_token_ids = torch.cat([tokens.unsqueeze(1), top_ids], dim=1)
            out.logprobs = torch.cat([sampled_lp, top_lp], dim=1)
        else:
            out.logprob_token_ids, out.logprobs = tokens.unsqueeze(1), sampled_lp


def _failed_rows(logits: torch.Tensor, tokens: torch.Tensor) -> list[int] | None:
    """Rows whose token is no token: outside the vocabulary, or one whose logit (after penalties and masks) is
    -inf or not a number. Masks that leave a row nothing, or values that overflow, end there; sampling such a
    row would feed the model an id it cannot embed. O(rows): one logit a row."""
    safe = tokens.clamp(0, logits.shape[1] - 1)
    bad = (safe != tokens) | ~torch.isfinite(logits.gather(1, safe.unsqueeze(1)).squeeze(1))
    return bad.nonzero().flatten().tolist() if bool(bad.any()) else None


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Forbid (set to the mask value) every token whose bit is 0; rows of all ones are left as they are."""
    rows = (bitmask != -1).any(dim=1).nonzero().flatten()
    if rows.numel() == 0:
        return logits
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.index_select(0, rows).unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : logits.shape[1]]
    logits[rows] = logits.index_select(0, rows).masked_fill(~allowed, _MASK)
    return logits


def _grammar_wins(logits: torch.Tensor, entry: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A constrained row whose other masks (min_tokens' EOS ban, allowed_token_ids, bad words) leave no token the
    grammar allows falls back to the grammar alone: the output stays valid rather than turning into token 0."""
    dead = (~torch.isfinite(logits).any(dim=1)).nonzero().flatten()
    if dead.numel():
        logits[dead] = apply_token_bitmask(entry.index_select(0, dead), bitmask.index_select(0, dead))
    return logits


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """vLLM's (and transformers') penalty rules, batched."""
    seen = p.output_counts > 0
    rep = torch.where(seen | p.prompt_mask, p.repetition.unsqueeze(1), torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - p.frequency.unsqueeze(1) * p.output_counts
    return logits - p.presence.unsqueeze(1) * seen.to(logits.dtype)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus p (k == 0 / p == 1 mean off). Keeps >= 1 token."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if k is not None:
        kk = torch.where(k <= 0, torch.full_like(k, vocab), k.clamp(max=vocab))
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= kk.unsqueeze(1), _MASK)
    if p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop = cum_before >= p.unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, _MASK)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
