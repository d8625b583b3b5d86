"""Memory a long-running engine must not keep: oneDNN's per-shape primitives and load-time heap garbage.

Both were found by the soak (benchmarks/soak.py): a SmolLM2 server's RSS grew ~14 MiB a minute for
half an hour. oneDNN makes a primitive per (weight shape, row count), and ideep (torch's oneDNN
layer) and oneDNN each cached up to 1,024 of them, at 0.3-0.6 MiB an entry, while a server's
flattened batches take hundreds of row counts; and glibc kept the ~0.27 GiB that loading freed.
Each check runs in a fresh interpreter: the caches' capacities are read once per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedllm.layers.linear import ONEDNN_CACHE_CAPACITY, onednn_available

_CHILD = r"""
import ctypes, json, os, sys
import torch
from pagedllm.benchmarks.soak import proc_stats
from pagedllm.layers.linear import PackedLinear, bound_onednn_caches

class MallInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks "
                                                "fordblks keepcost".split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo

def rss_mib():
    return proc_stats(os.getpid())["rss_mib"]

def heap_mib():  # bytes malloc holds for live allocations, free ones excluded
    return libc.mallinfo2().uordblks / 2**20

mode = sys.argv[1]
out = {}
if mode == "engine":  # the embedded model through the engine: its loader bounds the caches and trims
    from pagedllm import LLM
    llm = LLM(kv_cache_memory=64 << 20)
    rss = rss_mib()
    libc.malloc_trim(0)
    out["trim_returns_mib"] = rss - rss_mib()  # what glibc still held of loading's garbage
else:  # an operator's own capacity is kept
    os.environ["LRU_CACHE_CAPACITY"] = os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "1024"
    bound_onednn_caches()
out["capacities"] = [os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], os.environ["LRU_CACHE_CAPACITY"]]
torch.manual_seed(0)
layer = PackedLinear(torch.randn(576, 576), None)
layer(torch.randn(8, 576))
before = heap_mib()
for rows in range(5, 405):  # 400 row counts, as a server's batches take them
    layer(torch.randn(rows, 576))
out["primitive_heap_mib"] = heap_mib() - before
print(json.dumps(out))
"""


def _child(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    r = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not onednn_available() or not sys.platform.startswith("linux"), reason="oneDNN and glibc")
def test_engine_bounds_onednn_caches_and_returns_load_garbage():
    bounded, unbounded = _child("engine"), _child("operator")
    assert bounded["capacities"] == [str(ONEDNN_CACHE_CAPACITY)] * 2
    assert unbounded["capacities"] == ["1024", "1024"]  # the operator's value, not ours
    # 400 row counts: torch's default keeps a primitive for each, ours at most ONEDNN_CACHE_CAPACITY
    assert unbounded["primitive_heap_mib"] > 2.5 * bounded["primitive_heap_mib"], (bounded, unbounded)
    # what loading SmolLM2's GGUF freed (its repacking's temporaries; ~270 MiB when it was converted to our groups):
    # the engine has handed it back already
    assert bounded["trim_returns_mib"] < 32, bounded


_HEAP_CHILD = r"""
import json, sys
import torch
from pagedllm.worker.loader import keep_activations_in_heap

kept = keep_activations_in_heap() if sys.argv[1] == "keep" else None

def in_heap(address):
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
            return lo <= address < hi
    return False

steps = []
for _ in range(3):  # a 64 MiB activation, written, freed: what a prefill chunk's projection does
    x = torch.empty(16 << 20)
    x.fill_(1.0)
    steps.append(in_heap(x.data_ptr()))
    del x
print(json.dumps({"kept": kept, "in_heap": steps}))
"""


def _heap(mode: str, **env: str) -> dict:
    cmd = [sys.executable, "-c", _HEAP_CHILD, mode]
    r = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_activations_stay_in_the_heap_unless_the_operator_set_malloc():
    """Past glibc's mmap threshold (32 MiB at most by default) an allocation is a mapping of its own, unmapped at
    free, so its 16k pages fault in and are zeroed again at every step; a CPU worker keeps such allocations in
    the heap (a 512-token prefill on Qwen2.5-1.5B: 6-15 % less time). An operator's own malloc setting wins."""
    assert _heap("default") == {"kept": None, "in_heap": [False] * 3}
    assert _heap("keep") == {"kept": True, "in_heap": [True] * 3}
    assert _heap("keep", MALLOC_MMAP_THRESHOLD_="65536") == {"kept": False, "in_heap": [False] * 3}
    assert _heap("keep", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=65536")["kept"] is False
    assert _heap("keep", GLIBC_TUNABLES="glibc.rtld.optional_static_tls=4096")["kept"] is True  # not malloc's
