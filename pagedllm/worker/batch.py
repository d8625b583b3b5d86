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
    group_block_ids: Sequence[Sequence[int]] = ()  # the local groups' block ids (kv_groups), if any


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
    offsets = [0]
    qsl = [0]
    seq_lens: list[int] = []
    row_seg: list[int] = []  # the segment of each attention row
    num_decodes = 0
    for i, seg in enumerate(segments):
        n = len(seg.tokens)
        a, b = offsets[-1], offsets[-1] + n
        input_ids[a:b] = seg.tokens
        positions[a:b] = np.arange(seg.start, seg.start + n)
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
    seq_lens_t = torch.tensor(seq_lens, device=device)

    def metadata(block_ids: list[Sequence[int]]) -> AttentionMetadata:
        slots = np.empty(n_tok, dtype=np.int64)
        tables = np.zeros((len(segments), max(len(ids) for ids in block_ids)), dtype=np.int64)
        for i, ids in enumerate(block_ids):
            a, b = offsets[i], offsets[i + 1]
            bids = np.asarray(ids, dtype=np.int64)
            slots[a:b] = bids[positions[a:b] // block_size] * block_size + positions[a:b] % block_size
            tables[i, : len(ids)] = ids
        if len(row_seg) != len(segments):
            tables = tables[row_seg]
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(device),
            block_tables=torch.from_numpy(tables).to(device),
            seq_lens=seq_lens_t,
            num_decodes=num_decodes,
            query_start_loc=qsl,
            seq_lens_cpu=seq_lens,
            block_size=block_size,
        )

    meta = metadata([s.block_ids for s in segments])
    if segments and segments[0].group_block_ids:
        meta.groups = [
            metadata([s.group_block_ids[g] for s in segments]) for g in range(len(segments[0].group_block_ids))
        ]
    return Batch(torch.from_numpy(input_ids).to(device), torch.from_numpy(positions).to(device), meta, offsets)
