"""Builds the proposer a SpeculativeConfig names."""

from __future__ import annotations

import torch

from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.proposer import Proposer


def build_proposer(
    spec: SpeculativeConfig,
    draft: torch.nn.Module | None,
    draft_caches: list[torch.Tensor],
    block_size: int,
    device: torch.device,
    target: torch.nn.Module,
) -> Proposer:
    """``draft`` is the draft model or head (none for ngram), ``draft_caches`` its paged KV cache."""
    if spec.method == "ngram":
        from pagedllm.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft_model":
        from pagedllm.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(draft, draft_caches, spec.num_speculative_tokens, block_size, device)
    if spec.method in ("eagle", "eagle3"):
        from pagedllm.spec_decode.eagle import EagleProposer

        return EagleProposer(
            draft, draft_caches, spec.num_speculative_tokens, block_size, device, target.compute_logits
        )
    if spec.method == "medusa":
        from pagedllm.spec_decode.eagle import MedusaProposer

        return MedusaProposer(draft, spec.num_speculative_tokens)
    raise AssertionError(f"no proposer for {spec.method!r}")  # SpeculativeConfig admits only the methods above
