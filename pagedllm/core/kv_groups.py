"""Which layers share which block tables, when some layers attend over a sliding window (Gemma 3's local
layers): vLLM's hybrid KV cache layout, in the small.

A model whose layers all attend over the whole sequence needs one block table per request, every layer
reading the same blocks. A local layer needs only its window: the blocks behind it can be freed, but only
if the local layers have block tables of their own. So layers are put in *groups*, each group with its own
block table per request:

* group 0 holds the full-attention layers;
* the local layers follow in groups of the same size (by window; the last group of a window may be short).

Every group has as many *slots* as group 0 has layers, and slot ``s`` of every group lives in one cache
tensor: a block id names one page of each slot tensor, and whichever group holds the block uses it for its
layers. One block pool then serves every group, with one page size: a block is ``slots`` layers' worth of
K/V, not the whole model's, so the same memory holds ``num_layers / slots`` times as many blocks. A local
layer's request holds at most about ``window / block_size + 1`` blocks however long it runs.
"""

from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: None for group 0 (full attention), else the window in tokens
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its cache tensor

    @property
    def num_slots(self) -> int:
        return max(self.layer_slot) + 1

    @classmethod
    def plan(cls, layer_windows: list[int | None]) -> KVGroups | None:
        """The groups for layers with these windows (None: full attention); None where one table serves them
        all (no local layers, or no full-attention ones)."""
        full = [i for i, w in enumerate(layer_windows) if w is None]
        local = [i for i, w in enumerate(layer_windows) if w is not None]
        if not full or not local:
            return None
        size = len(full)
        group, slot = [0] * len(layer_windows), [0] * len(layer_windows)
        windows: list[int | None] = [None]
        for s, i in enumerate(full):
            slot[i] = s
        for window in sorted({w for w in layer_windows if w is not None}):
            layers = [i for i in local if layer_windows[i] == window]
            for start in range(0, len(layers), size):
                windows.append(window)
                for s, i in enumerate(layers[start : start + size]):
                    group[i], slot[i] = len(windows) - 1, s
        return cls(tuple(windows), tuple(group), tuple(slot))

    def blocks_for(self, num_tokens: int, block_size: int, chunk: int | None) -> int:
        """Blocks a lone request of ``num_tokens`` holds at most, computing at most ``chunk`` tokens a step
        (None: its whole prompt in one): all of its blocks in group 0; in a local group those of its window
        and of the step's tokens."""
        full = cdiv(num_tokens, block_size)
        if chunk is None:
            return full * len(self.windows)
        total = full
        for w in self.windows[1:]:
            assert w is not None  # only group 0 (full attention) has no window
            total += min(full, cdiv(w + chunk, block_size) + 1)
        return total

    def max_tokens(self, num_blocks: int, block_size: int, chunk: int | None) -> int:
        """The longest request ``num_blocks`` hold (see :meth:`blocks_for`)."""
        lo, hi = 0, num_blocks * block_size
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_for(mid, block_size, chunk) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo
