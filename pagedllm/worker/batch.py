"""One flattened token batch and its attention metadata, built from per-request segments.

A segment is a run of consecutive tokens of one request. A *split* segment attends as
one-token rows (each token a row whose context ends at itself): decodes, and the
drafts a request verifies under speculative decoding. Rows of one token are what the
batched decode path (and the C kernel that reads the paged cache in place) runs, so
a short query over a long cached context never takes the gather-and-mask prefill
path. Every K/V of the step is written before any is read, so token j of a split
segment sees tokens 0..j-1 of the same segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention import AttentionMetadata


@dataclass(slots=True)
class Segment:
    tokens: Sequence[int]
    start: int  # position of tokens[0]
    block_ids: Sequence[int]
    split: bool


@dataclass(slots=True)
class Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    offsets: list[int]  # flat index of each segment's first token; offsets[-1] == number of tokens


def build_batch(segments: Sequence[Segment], block_size: int, device: torch.device) -> Batch:
    """Split segments must come first (the backend runs the first ``num_decodes`` rows as decodes)."""
    n_tok = sum(len(s.tokens) for s in segments)
    input_ids = np.empty(n_tok, dtype=np.int64)
    positions = np.empty(n_tok, dtype=np.int64)
    slots = np.empty(n_tok, dtype=np.int64)
    offsets = [0]
    qsl = [0]
    seq_lens: list[int] = []
    row_seg: list[int] = []  # the segment of each attention row
    num_decodes = 0
    for i, seg in enumerate(segments):
        n = len(seg.tokens)
        a, b = offsets[-1], offsets[-1] + n
        input_ids[a:b] = seg.tokens
        pos = np.arange(seg.start, seg.start + n)
        positions[a:b] = pos
        bids = np.asarray(seg.block_ids, dtype=np.int64)
        slots[a:b] = bids[pos // block_size] * block_size + pos % block_size
        offsets.append(b)
        if seg.split or n == 1:
            assert num_decodes == len(seq_lens), "split segments must come first"
            qsl.extend(range(a + 1, b + 1))
            seq_lens.extend(range(seg.start + 1, seg.start + n + 1))
            row_seg.extend([i] * n)
            num_decodes += n
        else:
            qsl.append(b)
            seq_lens.append(seg.start + n)
            row_seg.append(i)
    max_blocks = max(len(s.block_ids) for s in segments)
    tables = np.zeros((len(segments), max_blocks), dtype=np.int64)
    for i, seg in enumerate(segments):
        tables[i, :len(seg.block_ids)] = seg.block_ids
    if len(row_seg) != len(segments):
        tables = tables[row_seg]
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device), block_tables=torch.from_numpy(tables).to(device),
        seq_lens=torch.tensor(seq_lens, device=device), num_decodes=num_decodes, query_start_loc=qsl,
        seq_lens_cpu=seq_lens, block_size=block_size)
    return Batch(torch.from_numpy(input_ids).to(device), torch.from_numpy(positions).to(device), meta, offsets)
