"""A CPU worker computes with the cores other processes leave free (pagedllm/worker/cpu_share.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidParameterError
from pagedllm.worker.cpu_share import CpuShare, cgroup_cpu_limit, read_busy_ticks

TICKS = os.sysconf("SC_CLK_TCK")


class FakeMachine:
    """/proc as a script: each second, how many cores others and this process kept busy."""

    def __init__(self) -> None:
        self.t, self.busy, self.ours = 0.0, 0, 0

    def run(self, seconds: float, others: float, ours: float) -> None:
        self.t += seconds
        self.busy += round((others + ours) * seconds * TICKS)
        self.ours += round(ours * seconds * TICKS)

    def read(self, cpus) -> tuple[int, int]:
        return self.busy, self.ours


def share(m: FakeMachine, limit: int = 4, cores: int = 4) -> CpuShare:
    return CpuShare(limit, interval=1.0, read=m.read, clock=lambda: m.t, cpus=list(range(cores)))


def two_looks(s: CpuShare, m: FakeMachine, others: float, ours: float) -> int:
    """Two seconds of the same load, a look after each: the count after them."""
    m.run(1.0, others, ours)
    s.threads_now()
    m.run(1.0, others, ours)
    return s.threads_now()


def test_an_idle_machine_keeps_every_thread_however_busy_the_worker_itself_is():
    m = FakeMachine()
    s = share(m)
    for _ in range(10):
        m.run(1.0, others=0.1, ours=4.0)
        assert s.threads_now() == 4
    assert s.changes == 0


def test_a_neighbour_holding_cores_takes_threads_away_and_gives_them_back_when_it_leaves():
    m = FakeMachine()
    s = share(m)
    m.run(1.0, others=2.0, ours=2.0)
    assert s.threads_now() == 4  # one look: a burst, perhaps
    m.run(1.0, others=2.0, ours=2.0)
    assert s.threads_now() == 2  # two looks agree: two cores are taken
    assert two_looks(s, m, others=3.0, ours=1.0) == 1
    assert two_looks(s, m, others=3.9, ours=0.1) == 1  # never below one
    assert two_looks(s, m, others=0.0, ours=1.0) == 4
    assert s.changes == 3


def test_a_one_second_burst_moves_nothing_and_the_count_never_passes_its_limit():
    m = FakeMachine()
    s = share(m, limit=2, cores=4)
    m.run(1.0, others=3.0, ours=1.0)
    s.threads_now()
    m.run(1.0, others=0.0, ours=2.0)
    assert s.threads_now() == 2
    assert two_looks(s, m, others=1.0, ours=2.0) == 2  # three cores free, but the limit is two
    assert s.changes == 0


def test_looks_closer_than_the_interval_reuse_the_last_answer():
    m = FakeMachine()
    s = share(m)
    reads = 0

    def counted(cpus):
        nonlocal reads
        reads += 1
        return m.read(cpus)

    s._read = counted
    for _ in range(100):
        m.run(0.01, others=4.0, ours=0.0)
        s.threads_now()
    assert reads == 1  # one second passed: /proc was read once, not per step


def test_proc_reading_counts_this_process_as_its_own():
    cpus = sorted(os.sched_getaffinity(0))
    busy0, ours0 = read_busy_ticks(cpus)
    t = time.process_time()
    while time.process_time() - t < 0.3:
        pass
    busy1, ours1 = read_busy_ticks(cpus)
    assert ours1 - ours0 >= 0.2 * TICKS  # the loop's CPU time is ours ...
    assert busy1 - busy0 >= ours1 - ours0 - 2  # ... and part of the machine's busy time (ticks round)


def test_a_containers_cpu_quota_is_read_from_cgroup_v2_and_v1_and_the_smallest_on_the_path_wins(tmp_path):
    v2 = tmp_path / "v2"
    (v2 / "kubepods" / "pod1").mkdir(parents=True)
    (v2 / "kubepods" / "cpu.max").write_text("400000 100000\n")
    (v2 / "kubepods" / "pod1" / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "v2.cgroup").write_text("0::/kubepods/pod1\n")
    assert cgroup_cpu_limit(str(v2), str(tmp_path / "v2.cgroup")) == 1.5
    (v2 / "kubepods" / "pod1" / "cpu.max").write_text("max 100000\n")  # no limit of its own: its parent's
    assert cgroup_cpu_limit(str(v2), str(tmp_path / "v2.cgroup")) == 4.0

    v1 = tmp_path / "v1" / "cpu,cpuacct" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "v1.cgroup").write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    assert cgroup_cpu_limit(str(tmp_path / "v1"), str(tmp_path / "v1.cgroup")) == 2.0
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no limit"
    assert cgroup_cpu_limit(str(tmp_path / "v1"), str(tmp_path / "v1.cgroup")) is None
    assert cgroup_cpu_limit(str(tmp_path), str(tmp_path / "missing")) is None


def test_cpu_threads_must_be_positive():
    with pytest.raises(InvalidParameterError, match="cpu_threads"):
        LLM(cpu_threads=0)


def _steps_thread_count(llm: LLM) -> int:
    import torch

    worker = llm.llm_engine.executor.worker
    assert worker._threads == torch.get_num_threads()  # the step runs in this thread here
    return worker._threads


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: nothing to give up")
def test_the_engine_gives_up_threads_to_busy_neighbours_and_its_tokens_do_not_change():
    cores = len(os.sched_getaffinity(0))
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    fixed = LLM(cpu_threads=cores)
    want = [o.outputs[0].token_ids for o in fixed.generate(prompts, sp, use_tqdm=False)]
    assert _steps_thread_count(fixed) == cores
    del fixed

    llm = LLM()
    share = llm.llm_engine.executor.worker.cpu_share
    assert share is not None and share.limit == llm.llm_engine.executor.worker.num_threads >= 2
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        deadline = time.monotonic() + 60
        while share.threads == cores and time.monotonic() < deadline:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            assert got == want
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert share.threads < share.limit, "a busy process on every core took no thread away in 60 s"
    assert _steps_thread_count(llm) == share.threads
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want  # fewer threads, the same tokens
