"""How many threads a CPU worker computes with while other processes share its cores.

Every parallel region of a step (a matmul, an attention, a kernel's rows) ends in a barrier that waits for
its slowest thread. A thread whose core another process holds runs only when the scheduler gives that
core back, a few milliseconds later, and every other thread waits for it, spinning. With two threads on
two cores and one busy neighbour process, a step of the 135M model took 3 to 6 times as long as with one
thread (`benchmarks/cpu_share.py`). So the worker takes the cores the others leave free: it reads how busy
its cores were since the last look, subtracts its own share, and uses what is left, at least one thread and
at most the count it started with. Its own threads are not "others", so the count does not chase itself
(another rank's process is: each rank of a tensor-parallel group counts the others' cores, and keeps its share).

Linux only (``/proc/stat`` and ``/proc/self/stat``); elsewhere the count stays as it started.

The count it starts with is bounded by the process's CPU quota too (:func:`usable_cores`): a container
limited to 2 CPUs on a 64-core host sees 64 cores, and 64 threads sharing 2 CPUs' worth of time stall on
each other as above, every quota period.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

# /proc/stat's per-CPU fields (user nice system idle iowait irq softirq steal ...), in clock ticks
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup") -> float | None:
    """CPUs' worth of time per second this process's cgroups allow (the smallest quota on its path), or None
    where none is set. cgroup v2 (``cpu.max``) and v1 (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``)."""
    try:
        lines = Path(membership).read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",")
        if controllers == "":  # v2: one hierarchy
            dirs, read = [Path(root)], _v2_quota
        elif "cpu" in names:
            dirs, read = [Path(root) / controllers, Path(root) / "cpu"], _v1_quota
        else:
            continue
        for base in dirs:
            parts = [p for p in path.split("/") if p]
            for depth in range(len(parts), -1, -1):  # the cgroup and each of its ancestors
                quota = read(base.joinpath(*parts[:depth]))
                if quota is not None:
                    limits.append(quota)
    return min(limits) if limits else None


def _v2_quota(d: Path) -> float | None:
    try:
        quota, period = (d / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(d: Path) -> float | None:
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())
        period = int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def usable_cores() -> int:
    """The cores this process may run on (its affinity), no more than its CPU quota allows (rounded up)."""
    cores = len(_cpus())
    quota = cgroup_cpu_limit()
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def read_busy_ticks(cpus: Iterable[int]) -> tuple[int, int]:
    """(ticks the given CPUs were busy, ticks this process ran), both since boot."""
    want = {f"cpu{c}" for c in cpus}
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            name, _, rest = line.partition(" ")
            if name in want:
                vals = rest.split()
                busy += sum(int(vals[i]) for i in _BUSY_FIELDS if i < len(vals))
    with open("/proc/self/stat") as f:
        fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
    return busy, int(fields[11]) + int(fields[12])  # utime, stime


class CpuShare:
    """The thread count for now: ``threads_now()`` before each step.

    Each ``interval`` seconds it measures the cores other processes kept busy on this process's CPUs and
    proposes ``round(cores - others)``, clamped to [1, ``limit``]; a proposal takes effect when two
    measurements in a row agree, so a burst of a second does not move it.
    """

    def __init__(
        self,
        limit: int,
        interval: float = 1.0,
        read: Callable[[Iterable[int]], tuple[int, int]] = read_busy_ticks,
        clock: Callable[[], float] = time.monotonic,
        cpus: list[int] | None = None,
    ):
        self.limit = max(1, limit)
        self.threads = self.limit
        self.interval = max(interval, 1e-3)
        self.cpus = cpus if cpus is not None else _cpus()
        self._read, self._clock = read, clock
        self._proposed: int | None = None
        self.changes = 0  # how many times the count moved (for tests and logs)
        try:
            self._last: tuple[float, int, int] | None = (clock(), *read(self.cpus))
        except (OSError, ValueError, IndexError):  # no /proc: keep the count as it started
            self._last = None

    def threads_now(self) -> int:
        if self._last is None:
            return self.threads
        now = self._clock()
        t0, busy0, ours0 = self._last
        if now - t0 < self.interval:  # most steps: no look at /proc
            return self.threads
        try:
            busy, ours = self._read(self.cpus)
        except (OSError, ValueError, IndexError):  # /proc unreadable for now (out of file descriptors, ...)
            return self.threads
        self._last = (now, busy, ours)
        others = max(0.0, (busy - busy0) - (ours - ours0)) / _TICKS / (now - t0)  # cores other processes kept busy
        proposal = min(self.limit, max(1, int(len(self.cpus) - others + 0.5)))
        if proposal != self.threads and proposal == self._proposed:
            self.threads = proposal
            self.changes += 1
        self._proposed = proposal
        return self.threads
