"""The suite's own housekeeping (tests/housekeeping.py): the progress line, the removal of what runs stopped
partway left, the check that nothing lands in the user's home."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from housekeeping import MARK, RAY_PREFIX, home_snapshot, remove_leftovers, write_mark

TESTS = Path(__file__).resolve().parent


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()  # (reaped: no process has the pid now)
    return proc.pid


def _run_folder(
    root: Path, name: str, owner: dict | None = None, live: bool = False, last: float | None = None
) -> Path:
    """A run's base folder, marked as ``owner``'s (or this process's, ``live``), last written at ``last``."""
    folder = root / name
    (folder / "popen-gw0" / "test_x0").mkdir(parents=True)
    if live:
        write_mark(folder)
    elif owner is not None:
        (folder / MARK).write_text(json.dumps(owner))
        os.utime(folder / MARK, (owner["time"], owner["time"]))  # (written when the run started)
    if last is not None:
        for path in (folder / "popen-gw0" / "test_x0", folder / "popen-gw0", folder):
            os.utime(path, (last, last))
    return folder


def test_only_the_folders_of_runs_that_are_not_running_go(tmp_path: Path) -> None:
    runs, tmp = tmp_path / "pytest-of-me", tmp_path / "tmp"
    tmp.mkdir()
    dead = {"pid": _dead_pid(), "start": None, "time": time.time()}
    stopped = _run_folder(runs, "pytest-1", dead)
    running = _run_folder(runs, "pytest-2", live=True)
    current = _run_folder(runs, "pytest-9", dead)  # (this run's own: never, whatever it holds)
    other_project = _run_folder(runs, "pytest-3")
    (other_project / ".lock").write_text(str(dead["pid"]))
    before_marks = _run_folder(runs, "pytest-4")  # a killed run of this suite from before marks
    (before_marks / "isolated").mkdir()
    (before_marks / ".lock").write_text(str(dead["pid"]))
    stopped_ray = _run_folder(tmp, RAY_PREFIX + "a", dead)
    running_ray = _run_folder(tmp, RAY_PREFIX + "b", live=True)
    someone_elses = _run_folder(tmp, "ray-c", dead)

    gone = remove_leftovers(runs, tmp, current)

    assert sorted(gone) == sorted([stopped, before_marks, stopped_ray])
    assert not any(p.exists() for p in gone)
    assert all(p.is_dir() for p in (running, current, other_project, running_ray, someone_elses))


def test_the_docs_paths_a_stopped_run_made_go_once_no_run_is_going(tmp_path: Path) -> None:
    runs, tmp = tmp_path / "pytest-of-me", tmp_path / "tmp"
    tmp.mkdir()
    now = time.time()
    made_by_it, there_before, made_after, untouched = (tmp_path / f"pagedllm-{n}" for n in ("a", "b", "c", "d"))
    docs = [made_by_it, there_before, made_after, untouched]
    for path in (made_by_it, there_before, made_after):
        path.mkdir()
        os.utime(path, (now - 700, now - 700))
    os.utime(made_after, (now, now))  # the user ran the example themselves, after the run had stopped
    owner = {"pid": _dead_pid(), "start": None, "time": now - 1000, "tmp_before": [str(there_before)]}
    stopped = _run_folder(runs, "pytest-1", owner, last=now - 500)  # its last test
    running = _run_folder(runs, "pytest-2", live=True)

    assert remove_leftovers(runs, tmp, runs / "pytest-9", docs) == [stopped]
    assert made_by_it.exists()  # a running run may be inside that example

    stopped = _run_folder(runs, "pytest-1", owner, last=now - 500)
    (running / MARK).unlink()
    assert remove_leftovers(runs, tmp, runs / "pytest-9", docs) == [made_by_it, stopped]
    assert there_before.exists() and made_after.exists() and not made_by_it.exists()


def test_a_new_ray_token_under_home_is_seen(tmp_path: Path) -> None:
    (tmp_path / ".cache" / "pip").mkdir(parents=True)
    before = home_snapshot(tmp_path)
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t")
    (tmp_path / ".cache" / "pip" / "x").write_text("")  # (not where the suite's libraries write)
    assert home_snapshot(tmp_path) - before == {".ray", ".ray/auth_token"}


_INNER_CONFTEST = """
import os
from pathlib import Path

import pytest

from housekeeping import Progress


class Seen(Progress):
    def line(self):
        text = super().line()
        if "running test_inner.py::test_long" in text:
            Path(os.environ["NAMED"]).touch()
        return text


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if not hasattr(config, "workerinput"):
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        threaded = config.pluginmanager.has_plugin("dsession")
        every_s = float(os.environ.get("EVERY_S", "30"))
        config.pluginmanager.register(Seen(config, reporter, threaded, every_s), "progress")
"""

_INNER_TESTS = """
import os
import time
from pathlib import Path

import pytest


@pytest.mark.parametrize("n", range(5))
def test_quick(n):
    pass


def test_long():  # runs until a progress line has named it (or ten minutes: then the line never came)
    named = Path(os.environ["NAMED"])
    deadline = time.monotonic() + 600
    while not named.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert named.exists()
"""


def _inner_pytest(tmp_path: Path, *args: str, every_s: str | None = None) -> str:
    (tmp_path / "conftest.py").write_text(_INNER_CONFTEST)
    (tmp_path / "test_inner.py").write_text(_INNER_TESTS)
    env = {**os.environ, "PYTHONPATH": str(TESTS), "NAMED": str(tmp_path / "long-was-named")}
    if every_s is not None:
        env["EVERY_S"] = every_s
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "bt"), *args]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    return r.stdout + r.stderr


def test_a_progress_line_names_what_runs_under_xdist_on_a_line_of_its_own(tmp_path: Path) -> None:
    out = _inner_pytest(tmp_path, "-n", "1", every_s="0.5")
    assert "6 passed" in out, out
    lines = [line for line in out.splitlines() if "[progress]" in line]
    assert lines and all(line.startswith("[progress] ") for line in lines), out
    assert any("passed of 6; running test_inner.py::test_long (" in line for line in lines), out


def test_a_short_run_in_one_process_prints_no_progress_line(tmp_path: Path) -> None:
    out = _inner_pytest(tmp_path, "test_inner.py::test_quick")
    assert "5 passed" in out and "[progress]" not in out, out
