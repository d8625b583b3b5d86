"""Read-only mappings of weight files, and letting their pages go once a copy holds the values.

A page of a read-only file mapping that this process read counts in its resident set until it is unmapped or
let go (``MADV_DONTNEED``); the page cache keeps it either way, and a later read maps it again. The loader lets
each tensor's pages go once its consumer converted them; a layer that copies a file's blocks into a layout of
its own later (GGUFLinear's panels) lets them go through :func:`release_mapped_pages`.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# the live mappings map_read_only made: id -> (first address, end, a weak reference)
_MAPPINGS: dict[int, tuple[int, int, weakref.ref[mmap.mmap]]] = {}
_LOCK = threading.Lock()


def map_read_only(path: str) -> mmap.mmap:
    """The whole of ``path`` mapped read-only, known to :func:`release_mapped_pages` until it is unmapped."""
    import numpy as np

    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    start = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
    key = id(mapping)
    with _LOCK:
        _MAPPINGS[key] = (start, start + len(mapping), weakref.ref(mapping))
    weakref.finalize(mapping, _forget, key)  # at its end (meanwhile a dead mapping's weak reference gives None)
    return mapping


def _forget(key: int) -> None:
    with _LOCK:
        _MAPPINGS.pop(key, None)


def release(mapping: mmap.mmap, start: int, n_bytes: int) -> None:
    """Let go of this process's pages of bytes [start, start + n_bytes) of ``mapping`` (the whole pages inside)."""
    page = mmap.PAGESIZE
    first, end = -(-start // page) * page, (start + n_bytes) // page * page
    if end > first and hasattr(mapping, "madvise"):
        mapping.madvise(mmap.MADV_DONTNEED, first, end - first)


def _holding(lo: int, n: int) -> tuple[mmap.mmap, int] | None:
    """The live mapping of :func:`map_read_only` that holds bytes [lo, lo + n) of memory, and its first address."""
    with _LOCK:
        for start, end, ref in _MAPPINGS.values():
            mapping = ref()
            if mapping is not None and start <= lo and lo + n <= end:
                return mapping, start
    return None


def release_whole_mapping(t: torch.Tensor) -> bool:
    """:func:`release` of the whole mapping that ``t`` lies in (one of :func:`map_read_only`), for a load that keeps
    a view of the file (a table only looked up): the pages that two copied tensors share, which each one's own
    release leaves, go too, and the view's pages fault in again as they are read. Whether ``t`` lay in one."""
    held = _holding(t.data_ptr(), 1)
    if held is not None:
        release(held[0], 0, len(held[0]))
    return held is not None


def release_mapped_pages(t: torch.Tensor) -> bool:
    """:func:`release` for a tensor that lies in a mapping of :func:`map_read_only`, such as a view of a file's
    blocks that a layer copied into a layout of its own. Whether ``t`` lay in one."""
    lo, n = t.data_ptr(), t.numel() * t.element_size()
    held = _holding(lo, n) if t.is_contiguous() else None
    if held is not None:
        release(held[0], lo - held[1], n)
    return held is not None
