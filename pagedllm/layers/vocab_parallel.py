"""The embedding and the logits head split by vocabulary rows across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import ParallelState


def vocab_shard(vocab_size: int, ps: ParallelState) -> tuple[int, int]:
    """``(first row, rows per rank)`` of this rank's vocabulary shard; the last shard is padded with zero
    rows where tp does not divide the vocabulary (their logits are cut off after the gather)."""
    per_rank = -(-vocab_size // ps.tp_size)
    return ps.tp_rank * per_rank, per_rank


class VocabParallelEmbedding(nn.Module):
    """Each rank looks up the tokens in its rows, zero elsewhere; one all-reduce assembles the embeddings."""

    def __init__(self, vocab_size: int, hidden_size: int, ps: ParallelState):
        super().__init__()
        self.ps = ps
        self.start, self.per_rank = vocab_shard(vocab_size, ps)
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ps.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.ps.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0.0))
