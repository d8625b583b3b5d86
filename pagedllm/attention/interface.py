"""The attention backend interface and the per-step metadata it reads.

The model runner orders each step's batch decodes first (one query token per
request), then everything else (prefill chunks, possibly on top of a cached
prefix). A backend writes the step's new K/V into the paged cache by
``slot_mapping`` and then attends over each request's blocks.

KV cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.

The implementations import these types from here; the selector
(:func:`pagedllm.attention.backend.get_attention_backend`) imports them, never
the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat slot (block_id * block_size + offset) of each new token
    block_tables: torch.Tensor  # [num_reqs, max_blocks] block ids, padded with 0
    seq_lens: torch.Tensor  # [num_reqs] tokens in the context after this step
    num_decodes: int  # the first num_decodes requests have exactly one query token
    # host-side copies for the per-request prefill loop (no device syncs)
    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens_cpu: list[int]
    block_size: int
    # per-step values a backend derives once and reuses in every layer (keyed by the backend)
    scratch: dict = field(default_factory=dict)
    # sliding-window layers with block tables of their own (pagedllm.core.kv_groups): group g's slot mapping
    # and tables are groups[g - 1]'s, the rest as here; None without such groups
    groups: list[AttentionMetadata] | None = None
    # Gemma 3's images: per prefill request (its index here), the [start, end) positions of the images its chunk
    # holds, whose tokens attend to each other both ways; None where no request has one
    bidirectional: dict[int, list[tuple[int, int]]] | None = None


class AttentionBackend(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; returns [T, H, D]."""
        ...
