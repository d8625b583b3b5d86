"""pagedllm.malloc_arena: an engine thread allocates from the main arena (glibc)."""

import ctypes
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"),
    reason="glibc's arenas",
)

_SCRIPT = """
import ctypes, sys, threading
from pagedllm.malloc_arena import share_main_arena
shared = share_main_arena() if sys.argv[1] == "share" else False
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
def work():  # what an engine thread does: blocks larger than a page, kept
    global kept
    kept = [libc.malloc(1 << 20) for _ in range(8)]
t = threading.Thread(target=work)
t.start(); t.join()
print(shared, flush=True)
libc.malloc_stats()  # per arena, to stderr
"""


def _arenas(mode: str) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, env=env, check=True)
    return out.stdout.strip(), out.stderr


def test_a_thread_started_after_share_main_arena_allocates_from_the_main_arena():
    shared, stats = _arenas("share")
    assert shared == "True"
    assert "Arena 0:" in stats and "Arena 1:" not in stats, stats
    # without it, glibc gives the thread an arena of its own: the check above can fail
    shared, stats = _arenas("default")
    assert shared == "False" and "Arena 1:" in stats, stats


def test_a_users_malloc_arena_max_is_left_alone():
    env = {**os.environ, "MALLOC_ARENA_MAX": "4"}
    code = "from pagedllm.malloc_arena import share_main_arena; print(share_main_arena())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"


_ENGINE_SCRIPT = """
import ctypes, sys
from pagedllm import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=256)
llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
ctypes.CDLL(None).malloc_stats()  # per arena, to stderr
"""


def test_an_offline_engines_threads_allocate_from_the_main_arena(tiny_model_factory):
    """LLM(...) from Python, as benchmarks/real_size.py runs it: the threads its engine starts (the tokenizer's
    load, the kernels' build) allocate from the main arena, where malloc_trim returns what they freed. With an
    arena of their own, the tokenizer's load left tens of MiB resident (a real-size GGUF's peak RSS 30-66 MiB
    higher)."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    model = str(tiny_model_factory("llama"))
    out = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT, model], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Arena 0:" in out.stderr and "Arena 1:" not in out.stderr, out.stderr[-2000:]
