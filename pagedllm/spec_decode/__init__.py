"""Speculative decoding: proposers behind one interface (see proposer.py); verification is in sample/."""

from __future__ import annotations

import torch

from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.proposer import ProposeContext, Proposer


def build_proposer(spec: SpeculativeConfig, draft: torch.nn.Module | None, draft_caches: list[torch.Tensor],
                   block_size: int, device: torch.device) -> Proposer:
    if spec.method == "ngram":
        from pagedllm.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft_model":
        from pagedllm.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(draft, draft_caches, spec.num_speculative_tokens, block_size, device)
    raise AssertionError(f"no proposer for {spec.method!r}")  # SpeculativeConfig admits only the methods above


__all__ = ["ProposeContext", "Proposer", "SpeculativeConfig", "build_proposer"]
