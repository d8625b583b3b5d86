"""The test run's own housekeeping, wired in by conftest.py: a progress line at least every 30 s, the removal of
what runs stopped partway left behind, and a check that the run wrote nothing under the user's home."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections import Counter
from collections.abc import Generator, Iterable
from pathlib import Path
from typing import Any

import pytest

# -- a progress line -------------------------------------------------------------------------------------------

PROGRESS_EVERY_S = 30.0
_ORDER = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


class Progress:
    """``[progress] 5m12s: 412 passed, 2 skipped of 1373; running tests/test_x.py::test_y (1m20s)``, at least every
    ``every_s`` once tests run: under xdist ``-q`` prints a dot per test and nothing while both workers are inside
    long tests (80 s and more), which reads as a hang.

    Under xdist the controller runs no test, and a timer thread prints the line; it holds ``lock``, as this
    plugin's wrappers around the reporter's result hooks do, so a line never lands inside a row of dots. In a
    single process the hooks print it instead (a thread's line would land in the running test's captured output),
    so a line waits for the test that runs to end."""

    def __init__(self, config: pytest.Config, reporter: Any, threaded: bool, every_s: float = PROGRESS_EVERY_S):
        self.config = config
        self.reporter = reporter
        self.threaded = threaded
        self.every_s = every_s
        self.lock = threading.Lock()
        self.started = self.last = time.monotonic()
        self.outcomes: Counter[str] = Counter()
        self.running: dict[str, float] = {}  # node id -> when it started
        self.session: pytest.Session | None = None
        self._stop = threading.Event()

    @pytest.hookimpl(wrapper=True, trylast=True)  # inside the reporter's wrapper: stopped before the summary
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, object, object]:
        self.session = session
        thread = threading.Thread(target=self._tick, name="progress", daemon=True)
        if self.threaded:
            thread.start()
        try:
            return (yield)
        finally:
            self._stop.set()
            if thread.is_alive():
                thread.join()

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_logstart(self, nodeid: str) -> Generator[None, object, object]:
        with self.lock:
            self.running[nodeid] = time.monotonic()
            return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> Generator[None, object, object]:
        with self.lock:
            try:
                return (yield)
            finally:
                category = self.config.hook.pytest_report_teststatus(report=report, config=self.config)[0]
                if category:
                    self.outcomes[category] += 1
                if not self.threaded and time.monotonic() - self.last >= self.every_s:
                    self._write()

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_logfinish(self, nodeid: str) -> Generator[None, object, object]:
        with self.lock:
            self.running.pop(nodeid, None)
            return (yield)

    def _tick(self) -> None:
        while not self._stop.wait(min(1.0, self.every_s / 4)):
            with self.lock:  # (from the first test on: before it, xdist writes its own lines about the workers)
                if (self.running or self.outcomes) and time.monotonic() - self.last >= self.every_s:
                    self._write()

    def line(self) -> str:
        now = time.monotonic()
        done = ", ".join(f"{self.outcomes[k]} {k}" for k in sorted(self.outcomes, key=_rank) if self.outcomes[k])
        total = self.session.testscollected if self.session is not None else 0
        text = f"[progress] {_duration(now - self.started)}: {done or 'none finished'}"
        if total:
            text += f" of {total}"
        if self.running:
            text += "; running " + ", ".join(f"{n} ({_duration(now - t)})" for n, t in self.running.items())
        return text

    def _write(self) -> None:
        tw = self.reporter._tw
        if tw.width_of_current_line:  # (a row of dots: the line goes under it, the dots go on after it)
            tw.line()
        tw.line(self.line())
        tw.flush()
        self.reporter.currentfspath = None
        self.last = time.monotonic()


def _rank(category: str) -> int:
    return _ORDER.index(category) if category in _ORDER else len(_ORDER)


# -- what runs stopped partway left ----------------------------------------------------------------------------
#
# A run writes MARK (its process and when it started) into its base folder under pytest-of-<user>, and into its
# Ray folder where it needs one of its own; a run that starts removes the folders whose run is gone, and the
# docs' examples' /tmp/pagedllm-* paths such a run made. pytest removes a finished run's folder itself (at the
# end of the next run), but a killed run's stays for three days (its lock file outlives it), 2.5 GB each here.

MARK = "pagedllm-tests.json"
RAY_PREFIX = "pagedllm-tests-ray-"
_DOCS_TMP = re.compile(r"/tmp/pagedllm-[\w.-]+")


def _start_time(pid: int) -> str | None:
    """When the process started (clock ticks after boot; Linux): tells it from a later process with its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the fields after the command's ')' start at 3


def _alive(owner: dict[str, Any]) -> bool:
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    started = owner.get("start")
    now = _start_time(pid)
    return started is None or now is None or now == started


def write_mark(folder: Path, **extra: Any) -> None:
    """Marks ``folder`` as this process's, for as long as it runs."""
    owner = {"pid": os.getpid(), "start": _start_time(os.getpid()), "time": time.time(), **extra}
    (folder / MARK).write_text(json.dumps(owner))


def _owner(folder: Path) -> dict[str, Any] | None:
    """Whose run ``folder`` is: its mark, or for a run from before marks (this conftest's ``isolated`` folder in
    it), pytest's own lock file, which holds the pid and stays behind when the run is killed."""
    try:
        owner = json.loads((folder / MARK).read_text())
        return owner if isinstance(owner, dict) else None
    except FileNotFoundError:
        pass
    except (OSError, ValueError):
        return None
    if not (folder / "isolated").is_dir():
        return None
    try:
        return {"pid": int((folder / ".lock").read_text())}
    except (OSError, ValueError):
        return None


def _last_written(folder: Path) -> float:
    """About when the run in ``folder`` last wrote there: every test makes and removes a folder two levels down."""
    times = [folder.stat().st_mtime]
    for child in folder.iterdir():
        times.append(child.lstat().st_mtime)
        if child.is_dir() and not child.is_symlink():
            times += [grandchild.lstat().st_mtime for grandchild in child.iterdir()]
    return max(times)


def docs_tmp_paths(root: Path) -> set[Path]:
    """The /tmp/pagedllm-* paths the docs' examples write (tests/test_docs_examples.py runs them as written)."""
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    return {Path(m) for page in pages if page.is_file() for m in _DOCS_TMP.findall(page.read_text())}


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_leftovers(runs: Path | None, tmp: Path, current: Path, docs_paths: Iterable[Path] = ()) -> list[Path]:
    """Removes what runs of this suite that are not running any more left behind: their base folders in ``runs``
    (pytest-of-<user>; never ``current``, nor a folder without a mark, such as another project's), their Ray
    folders in ``tmp``, and those of ``docs_paths`` one of them made (written after it started and before it
    stopped, absent when it started), unless a run is still going. Returns what it removed."""
    dead: list[tuple[Path, dict[str, Any]]] = []
    live = False
    folders = [f for f in runs.glob("pytest-*") if f != current] if runs is not None and runs.is_dir() else []
    for folder in [*folders, *tmp.glob(RAY_PREFIX + "*")]:
        if folder.is_symlink() or not folder.is_dir() or (owner := _owner(folder)) is None:
            continue
        if _alive(owner):
            live = True
        else:
            dead.append((folder, owner))
    gone: list[Path] = []
    if not live:
        for folder, owner in dead:
            if "tmp_before" not in owner:
                continue
            stopped = _last_written(folder) + 60
            for path in docs_paths:
                if str(path) in owner["tmp_before"] or not os.path.lexists(path):
                    continue
                if owner["time"] - 1 <= path.lstat().st_mtime <= stopped:
                    _remove(path)
                    gone.append(path)
    for folder, _ in dead:
        _remove(folder)
        gone.append(folder)
    return gone


# -- nothing under the user's home -----------------------------------------------------------------------------

# where the libraries the suite drives write by default (conftest points HOME and the XDG folders elsewhere)
WATCHED = (".ray", ".cache/huggingface", ".cache/torch", ".cache/pagedllm", ".triton", ".config/matplotlib")


def home_snapshot(home: Path) -> set[str]:
    """The folders directly in ``home`` and everything under WATCHED, as paths relative to ``home``."""
    seen = {p.name for p in home.iterdir() if p.is_dir()} if home.is_dir() else set()
    for rel in WATCHED:
        for dirpath, dirnames, filenames in os.walk(home / rel):
            seen.add(os.path.relpath(dirpath, home))
            seen.update(os.path.relpath(os.path.join(dirpath, name), home) for name in filenames)
            seen.update(os.path.relpath(os.path.join(dirpath, name), home) for name in dirnames)
    return seen
