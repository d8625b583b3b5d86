"""Verifying speculative drafts: keep the longest acceptable prefix, then one token more.

The target model scores every draft position in one pass, and the sampler runs on
each of those k+1 rows exactly as it would without speculation: row j sees the
request's tokens plus drafts[:j] (penalties, bad words, min_tokens and logits
processors read that history) and draws with the request's seed at its own output
position. Call its draws ``target``.

* A proposer with no distribution (n-gram, and the built-in proposers, which draft
  greedily) has a one-hot q. Then the rule "accept x with probability
  min(1, p(x)/q(x)) = p(x); on rejection resample from norm(max(0, p - q))" is
  realised exactly by accepting while ``drafts[j] == target[j]`` and emitting
  ``target[j]`` at the first mismatch (or the bonus ``target[k]``): target[j] ~ p,
  so it equals x with probability p(x), and given it does not, it is distributed as
  p without x, renormalised. The same draws also make a seeded request give the
  same tokens with or without speculation. Greedy rows are the case p one-hot.
* A proposer that returns its draft distribution q gets the general rule: accept x
  with probability min(1, p(x)/q(x)) using a uniform from the request's own stream
  at that position; on rejection sample norm(max(0, p - q)) with the position's
  own draw (sampler.draw). Exact in distribution and reproducible with the seed, but not
  token-identical to decoding without speculation (no rule can be, for such q).
"""

from __future__ import annotations

import torch

from pagedllm.sample.sampler import draw, uniform

_ACCEPT_SALT = 0x5EC0DE


def verify(
    drafts: list[int],
    target: list[int],
    *,
    draft_probs: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
    seed: int = 0,
    position: int = 0,
) -> list[int]:
    """The tokens to emit: the accepted drafts and one more.

    ``target``: the sampler's token at each of the len(drafts) + 1 rows; ``probs`` [k, V]: the processed
    distribution at the draft rows (needed with ``draft_probs`` [k, V], the proposer's q); ``position``:
    the output position of the first row.
    """
    if draft_probs is None:
        a = 0
        while a < len(drafts) and drafts[a] == target[a]:
            a += 1
        return target[: a + 1]
    assert probs is not None, "probs come with draft_probs"
    out: list[int] = []
    for j, x in enumerate(drafts):
        p, q = probs[j], draft_probs[j]
        if uniform(seed, position + j, _ACCEPT_SALT) * q[x].item() < p[x].item():
            out.append(x)
            continue
        residual = (p - q).clamp(min=0.0)
        if not residual.sum() > 0:  # p == q: rejection has probability 0; guard the arithmetic anyway
            residual = p
        out.append(int(draw(residual.unsqueeze(0), [seed], [position + j])[0]))
        return out
    out.append(target[len(drafts)])
    return out
