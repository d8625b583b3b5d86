"""The batched sampler against independent reference computations."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.sample.sampler import Sampler, SamplingBatch, apply_top_k_top_p, draw


def _batch(
    n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, positions=None, logprobs=None, stop_masks=None
):
    def col(v, dtype):
        return torch.tensor(v if isinstance(v, list) else [v] * n, dtype=dtype)

    t, k, p, m = (
        col(temperature, torch.float32),
        col(top_k, torch.long),
        col(top_p, torch.float32),
        col(min_p, torch.float32),
    )
    return SamplingBatch(
        t,
        k,
        p,
        m,
        seeds or list(range(n)),
        positions or [0] * n,
        stop_masks or [None] * n,
        logprobs or [None] * n,
        all_greedy=bool((t == 0).all()),
        no_top_k=bool((k == 0).all()),
        no_top_p=bool((p >= 1).all()),
        no_min_p=bool((m == 0).all()),
    )


def _reference_probs(logits, temperature, top_k, top_p, min_p):
    """Straightforward per-row reference, in vLLM's / transformers' order: top-k, renormalise, nucleus."""
    z = logits / temperature
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = order[:top_k] if top_k > 0 else order
    total = sum(math.exp(z[i].item()) for i in keep)
    mass, nucleus = 0.0, []
    for i in keep:
        if mass >= top_p and nucleus:
            break
        nucleus.append(i)
        mass += math.exp(z[i].item()) / total
    kept = torch.tensor([z[i].item() if i in nucleus else -math.inf for i in range(len(z))])
    p = torch.softmax(kept, dim=0)
    p = torch.where(p < min_p * p.max(), torch.zeros_like(p), p)
    return p / p.sum()


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 1.0), (0, 0.6), (4, 0.8), (1, 1.0), (0, 0.01)])
def test_top_k_top_p_mask_matches_reference(top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(3, 12)
    out = apply_top_k_top_p(logits.clone(), torch.tensor([top_k] * 3), torch.tensor([top_p] * 3))
    for row in range(3):
        ref = _reference_probs(logits[row], 1.0, top_k, top_p, 0.0)
        got = torch.softmax(out[row], dim=0)
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=4),
        dict(temperature=1.0, top_p=0.7),
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=0.9, top_k=5, top_p=0.9, min_p=0.05),
    ],
)
def test_sampled_distribution_equals_processed_distribution(cfg):
    """Chi-square goodness of fit over many seeded draws on an 8-token vocabulary."""
    torch.manual_seed(1)
    logits = torch.randn(8) * 1.5
    expected = _reference_probs(
        logits, cfg.get("temperature", 1.0), cfg.get("top_k", 0), cfg.get("top_p", 1.0), cfg.get("min_p", 0.0)
    )
    n = 4000
    batch = _batch(n, **cfg, seeds=[17] * n, positions=list(range(n)))
    tokens = Sampler()(logits.repeat(n, 1), batch).token_ids
    counts = torch.bincount(tokens, minlength=8).double()
    assert counts[expected == 0].sum() == 0, "sampled a token the processed distribution excludes"
    live = expected > 0
    exp = expected[live].double() * n
    chi2 = (((counts[live] - exp) ** 2) / exp).sum().item()
    dof = int(live.sum()) - 1
    # 99.9% quantile of chi-square for dof <= 7 is < 24.4; a wrong distribution at n=4000 lands far above
    assert dof == 0 or chi2 < 24.4, f"chi2={chi2:.1f} dof={dof} counts={counts.tolist()} expected={exp.tolist()}"


def test_greedy_rows_take_argmax_in_a_mixed_batch():
    torch.manual_seed(2)
    logits = torch.randn(4, 50)
    batch = _batch(4, temperature=[0.0, 1.0, 0.0, 1.0])
    out = Sampler()(logits.clone(), batch).token_ids
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_seed_and_position_fix_the_draw_regardless_of_batch():
    torch.manual_seed(3)
    logits = torch.randn(5, 100)
    full = Sampler()(logits.clone(), _batch(5, seeds=[1, 2, 3, 4, 5], positions=[0, 1, 2, 3, 4])).token_ids
    single = Sampler()(logits[3:4].clone(), _batch(1, seeds=[4], positions=[3])).token_ids
    assert full[3] == single[0]


def test_a_draw_is_each_rows_own_across_chunks_and_never_an_index_without_weight():
    torch.manual_seed(4)
    w = torch.rand(70, 300) * (torch.rand(70, 300) < 0.3)  # about 70 % of the entries weigh nothing
    w[:, 7] += 1e-3  # every row has some weight
    seeds, positions = list(range(70)), [5] * 70
    batched = draw(w, seeds, positions)  # 70 rows: three chunks of the float64 sums
    alone = torch.cat([draw(w[i : i + 1], [seeds[i]], [positions[i]]) for i in range(70)])
    assert torch.equal(batched, alone)
    assert bool((w.gather(1, batched.unsqueeze(1)) > 0).all())
    # the frequencies follow the weights
    row = torch.tensor([[0.1, 0.0, 0.5, 0.25, 0.15]])
    counts = torch.bincount(torch.cat([draw(row, [9], [p]) for p in range(20000)]), minlength=5).double() / 20000
    assert counts[1] == 0 and torch.allclose(counts, row[0].double(), atol=0.015)


def test_logprobs_are_raw_log_softmax_with_rank():
    torch.manual_seed(4)
    logits = torch.randn(2, 30)
    out = Sampler()(logits.clone(), _batch(2, temperature=0.0, logprobs=[3, None]))
    ref = torch.log_softmax(logits, dim=-1)
    top = ref.topk(3, dim=-1)
    assert out.logprob_token_ids[0, 1:].tolist() == top.indices[0].tolist()
    torch.testing.assert_close(out.logprobs[0, 1:], top.values[0])
    assert out.sampled_ranks[0] == 1  # greedy picks rank 1


def test_min_tokens_mask_forbids_stop_tokens():
    logits = torch.zeros(1, 10)
    logits[0, 7] = 100.0
    out = Sampler()(logits.clone(), _batch(1, temperature=0.0, stop_masks=[[7]])).token_ids
    assert out[0] != 7


def _penalty_reference(logits, prompt, output, presence, frequency, repetition):
    """One row, token by token, straight from the definitions."""
    out = logits.clone()
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
        count = output.count(t)
        out[t] -= frequency * count + presence * (count > 0)
    return out


@pytest.mark.parametrize(
    "presence, frequency, repetition",
    [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.3), (-0.4, 0.3, 0.8), (1.0, 1.0, 2.0)],
)
def test_penalties_match_reference(presence, frequency, repetition):
    from pagedllm.sample.sampler import Penalties, apply_penalties

    torch.manual_seed(5)
    vocab = 20
    logits = torch.randn(2, vocab) * 3
    prompts, outputs = [[1, 2, 3], [4, 4]], [[3, 5, 5, 5], []]
    counts = torch.zeros(2, vocab)
    mask = torch.zeros(2, vocab, dtype=torch.bool)
    for i in range(2):
        for t in outputs[i]:
            counts[i, t] += 1
        mask[i, prompts[i]] = True
    pen = Penalties(
        torch.tensor([presence] * 2), torch.tensor([frequency] * 2), torch.tensor([repetition] * 2), counts, mask
    )
    got = apply_penalties(logits, pen)
    for i in range(2):
        ref = _penalty_reference(logits[i], prompts[i], outputs[i], presence, frequency, repetition)
        torch.testing.assert_close(got[i], ref)


def test_bias_bans_and_biases_before_sampling_but_not_raw_logprobs():
    torch.manual_seed(6)
    logits = torch.randn(1, 10)
    bias = torch.zeros(1, 10)
    bias[0, logits[0].argmax()] = float("-inf")  # ban the favourite
    bias[0, 3] += 50.0
    out = Sampler()(
        logits.clone(),
        _batch(1, temperature=0.0, logprobs=[2]).__class__(
            **{
                **{f: getattr(_batch(1, temperature=0.0, logprobs=[2]), f) for f in SamplingBatch.__slots__},
                "bias": bias,
            }
        ),
    )
    assert out.token_ids[0] == 3
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[0, 0].item() == pytest.approx(raw[0, 3].item())  # raw distribution, not the biased one
