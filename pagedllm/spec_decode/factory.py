"""Builds the proposer a SpeculativeConfig names."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from pagedllm.models.llama import LlamaForCausalLM
    from pagedllm.models.spec_heads import EagleHead, MedusaHead


def build_proposer(
    spec: SpeculativeConfig,
    draft: torch.nn.Module | None,
    draft_caches: list[torch.Tensor],
    block_size: int,
    device: torch.device,
    target: LlamaForCausalLM,
) -> Proposer:
    """``draft`` is the draft model or head (none for ngram), ``draft_caches`` its paged KV cache."""
    if spec.method == "ngram":
        from pagedllm.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    assert draft is not None, f"the worker loads the {spec.method} draft first"
    # the loader knows the draft only as an nn.Module: the method says which one it built
    if spec.method == "draft_model":
        from pagedllm.spec_decode.draft_model import DraftModelProposer

        ngram = None
        if spec.ngram_first:
            from pagedllm.spec_decode.ngram import NgramProposer

            # the longest suffix only: a shorter match drafts worse than the model, and takes its step
            ngram = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_max)
        return DraftModelProposer(
            cast("LlamaForCausalLM", draft), draft_caches, spec.num_speculative_tokens, block_size, device, ngram
        )
    if spec.method in ("eagle", "eagle3"):
        from pagedllm.spec_decode.eagle import EagleProposer

        return EagleProposer(
            cast("EagleHead", draft),
            draft_caches,
            spec.num_speculative_tokens,
            block_size,
            device,
            target.compute_logits,
        )
    if spec.method == "medusa":
        from pagedllm.spec_decode.eagle import MedusaProposer

        return MedusaProposer(cast("MedusaHead", draft), spec.num_speculative_tokens)
    raise AssertionError(f"no proposer for {spec.method!r}")  # SpeculativeConfig admits only the methods above
