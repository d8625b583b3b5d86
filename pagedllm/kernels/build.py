"""Compile the C kernels once per source version and CPU, cache the .so, load it with ctypes.

The sources sit next to this file (package data: ``"pagedllm.kernels" = ["*.c", "*.h"]``). ``load`` and
``try_load`` are cached: the process loads the library once.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import torch

from pagedllm.kernels import isa
from pagedllm.kernels.ops import Kernels

logger = logging.getLogger("pagedllm")

_DIR = os.path.dirname(__file__)
_SOURCES = [
    os.path.join(_DIR, f)
    for f in (
        "quant_matmul.c",
        "paged_attention.c",
        "elementwise.c",
        "decode_loop.c",
        "gguf_blocks.c",
    )
]
_HEADERS = [
    os.path.join(_DIR, name)
    for name in (
        "vec_math.h",
        "gguf_types.h",
        "gguf_panels.h",
        "gguf_dequant.h",
        "gguf_rows.h",
        "gguf_panels_avx512.h",
        "gguf_panels_amx.h",
        "gguf_panels_avx2.h",
    )
]


def library_flags(level: str) -> list[str]:
    """The compiler's flags for the kernels' shared library at instruction-set ``level``."""
    return ["-O3", *isa.compile_flags(level), "-fopenmp", "-shared", "-fPIC"]


T = TypeVar("T")


class _Once(Generic[T]):
    """``functools.cache`` for a function of no arguments, whose body also runs once when threads call it together
    (the background build and the engine's own call: both missed ``functools.cache``, built one after the other and
    logged twice). ``cache_clear`` and ``__wrapped__`` as ``functools.cache`` has them; an exception is not kept."""

    def __init__(self, fn: Callable[[], T]):
        functools.update_wrapper(self, fn)
        self.__wrapped__ = fn
        self._lock = threading.Lock()
        self._value: list[T] = []

    def __call__(self) -> T:
        done = self._value  # (the common case, per layer and step: no lock once the value is there)
        if done:
            return done[0]
        with self._lock:
            if not self._value:
                self._value.append(self.__wrapped__())
            return self._value[0]

    def cache_clear(self) -> None:
        with self._lock:
            self._value = []  # (a new list: a call reading the old one without the lock still finds its value)


@_Once
def load() -> Kernels:
    """Build (once per source version and instruction-set level) and load the kernels; raises KernelBuildError when
    that fails, and :class:`~pagedllm.kernels.isa.CPULevelError` for a ``$PAGEDLLM_CPU_LEVEL`` this machine cannot
    run (not a fallback: the level asked for is the point)."""
    from pagedllm.model_loader.cache import cache_root

    cc = os.environ.get("CC", "cc")
    level, why = isa.chosen_level()
    flags = library_flags(level)
    # -mtune=native: a cache shared between machines must not hand one CPU's build to another
    digest = hashlib.sha256(" ".join([cc, *flags, platform.machine(), *sorted(isa.cpu_flags())]).encode())
    for src in _SOURCES + _HEADERS:
        with open(src, "rb") as f:
            digest.update(f.read())
    out_dir = os.path.join(cache_root(), "kernels")
    path = os.path.join(out_dir, f"pagedllm-kernels-{digest.hexdigest()[:16]}.so")
    if not os.path.exists(path):  # (one build per process: `_Once`; a second caller waits for it)
        if shutil.which(cc) is None:
            raise KernelBuildError(
                f"pagedllm's C kernels are compiled on first use, but no C compiler ({cc!r}; set $CC) was found"
            )
        with _across_processes(out_dir, path):  # and one per machine: TP ranks, replicas, test workers
            if not os.path.exists(path):  # (built by the process that held the lock before this one)
                _build(cc, flags, out_dir, path)
    try:
        kernels = Kernels(ctypes.CDLL(path), level)
    except OSError as e:  # e.g. a cached build this system can no longer load
        raise KernelBuildError(f"loading pagedllm's C kernels from {path} failed: {e}") from e
    logger.info("C kernels: the %s instruction-set level (%s; of %s)", level, why, ", ".join(isa.machine_levels()))
    amx = isa.amx_note(level)
    if amx:
        logger.info("%s", amx)
    return kernels


# how long a process waits for another's build of the same library before it builds its own (a holder that hangs)
_BUILD_WAIT_S = 600.0


@contextlib.contextmanager
def _across_processes(out_dir: str, path: str) -> Iterator[None]:
    """An advisory lock on ``path`` + ".lock" (``flock``: the kernel drops it when its holder exits, however it
    ends), so that processes starting together on a fresh cache compile once and the others wait for that .so (a
    log line says so). Where the lock cannot be taken (no ``fcntl``, a file system without locks, a holder that has
    not finished in ``_BUILD_WAIT_S``) a process builds on its own, as before: the .so still appears atomically."""
    fd = None
    try:
        os.makedirs(out_dir, exist_ok=True)
        try:
            fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:  # a cache shared between users: flock needs only a descriptor
            fd = os.open(path + ".lock", os.O_RDONLY)
    except OSError:
        pass
    if fd is None:
        yield
        return
    try:
        if not _try_lock(fd):
            logger.info("waiting for another process's build of pagedllm's C kernels (%s)", path)
            deadline = time.monotonic() + _BUILD_WAIT_S
            while not _try_lock(fd):
                if time.monotonic() > deadline:
                    logger.warning("another process's build of %s ran past %.0f s: building here", path, _BUILD_WAIT_S)
                    break
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _try_lock(fd: int) -> bool:
    """Take the lock on fd if no other process holds it; True also where there are no locks (no ``fcntl``, a file
    system without them)."""
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except (ImportError, OSError):
        return True
    return True


def _build(cc: str, flags: list[str], out_dir: str, path: str) -> None:
    """Compile each source in its own process (in parallel), then link; the .so appears atomically."""
    logger.info("compiling pagedllm's C kernels for this CPU (once; cached in %s)", out_dir)
    t0 = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        objects = [os.path.join(tmp, os.path.basename(src) + ".o") for src in _SOURCES]
        compile_flags = [f for f in flags if f != "-shared"]
        compiles = [
            subprocess.Popen(
                [cc, *compile_flags, "-c", src, "-o", obj], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for src, obj in zip(_SOURCES, objects)
        ]
        steps: list[tuple[subprocess.Popen[str] | subprocess.CompletedProcess[str], str]] = [
            (proc, proc.communicate()[1]) for proc in compiles
        ]
        so = os.path.join(tmp, "kernels.so")
        if all(proc.returncode == 0 for proc, _ in steps):
            link = subprocess.run([cc, *flags, *objects, "-o", so], capture_output=True, text=True)
            steps.append((link, link.stderr))
        failed = [err for proc, err in steps if proc.returncode != 0]
        if failed:
            raise KernelBuildError(
                f"building pagedllm's C kernels failed ({cc} {' '.join(flags)}):\n{failed[0].strip()}"
            )
        os.replace(so, path)  # atomic: a concurrent loader sees no file or a whole one
    logger.info("compiled pagedllm's C kernels in %.1fs", time.perf_counter() - t0)


def build_in_background() -> None:
    """Start building the kernels on a thread, so the compiler runs while the model loads."""
    threading.Thread(target=try_load, name="pagedllm-kernel-build", daemon=True).start()


class KernelBuildError(RuntimeError):
    pass


def for_tensor(x: torch.Tensor) -> Kernels | None:
    """The kernels where ``x`` is a float32 CPU tensor outside autograd and they could be built, else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.requires_grad:
        return None
    return try_load()


@_Once
def try_load() -> Kernels | None:
    """The kernels, or None (with one warning) where they cannot be built: callers fall back to torch."""
    try:
        return load()
    except KernelBuildError as e:
        logger.warning("%s; using the plain-torch paths instead", e)
        return None
