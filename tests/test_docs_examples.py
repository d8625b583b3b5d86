"""Every example in the README and the documentation site runs as written, and the site builds.

Each fenced ``python`` or ``bash`` block of README.md and docs/**/*.md runs from the repository root in
bash, after ``source .venv/bin/activate`` (the step the docs tell a user to take once after set-up):
a bash block as one script under ``set -euo pipefail``, a Python block saved to a file and run by
``python``. Other languages (``text``, ``json``, ``yaml``, ...) are shown, not run. An HTML comment on
the line right before a fence changes that:

- ``<!-- server: pagedllm serve ARGS -->``: the block talks to that server, which the test starts
  (once per distinct ARGS, on a free port: ``127.0.0.1:8000`` in the block is rewritten to it);
- ``<!-- skip-ci: REASON -->``: not run here (a GPU, a second machine, Docker); the skips list them;
- ``<!-- test-command -->``: the README's test command, which is what runs this suite.

A bash block ending in a ``pagedllm serve ...`` command runs what comes before it, then starts the
server as written (with ``--port`` of a free port added), waits for ``/health`` and stops it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from utils import _free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN = ("python", "bash")
_FENCE = re.compile(
    r"(?:^<!--\s*(?P<marker>[^>]*?)\s*-->\n)?"  # an optional marker on the line right before the fence
    r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<code>.*?)^(?P=indent)```",
    re.S | re.M,
)
_SERVE_LAST = re.compile(r"(?:^|&&|;|\n)\s*(?P<serve>(?:\.venv/bin/)?pagedllm serve\b(?:[^\n\\]|\\\n)*)\s*$")
_ADDRESS = re.compile(r"(127\.0\.0\.1|localhost):8000\b")


def _blocks() -> list:
    found = []
    for page in PAGES:
        text = page.read_text()
        rel = page.relative_to(ROOT)
        for m in _FENCE.finditer(text):
            if m["lang"] not in RUN:
                continue
            line = text.count("\n", 0, m.start("indent")) + 1
            code = textwrap.dedent(m["code"]) if m["indent"] else m["code"]
            found.append(pytest.param(m["lang"], m["marker"] or "", code, id=f"{rel}:{line}"))
    return found


BLOCKS = _blocks()


def test_the_pages_hold_examples():
    pages = {p.id.split(":")[0] for p in BLOCKS}
    assert len(BLOCKS) >= 20 and "README.md" in pages and len(pages) >= 8, sorted(pages)


def test_readme_is_a_landing_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 160, "the README grew past a landing page: move the detail into docs/"
    fences = [m for m in _FENCE.finditer(text) if m["lang"] == "bash"]
    assert "install.sh" in fences[0]["code"] and "pagedllm serve" in fences[0]["code"]
    assert fences[1]["marker"] == "test-command" and "pytest" in fences[1]["code"]


def test_every_example_bounds_its_output():
    """Sampling without a bound can run to the context length (minutes): each generating call says how much."""
    for param in BLOCKS:
        lang, _, code = param.values
        if lang == "python":
            calls = re.findall(r"\.(?:generate|chat|create|beam_search)\(", code)
            bounds = re.findall(r"max_(?:completion_|output_)?tokens=\d+", code)
            assert len(bounds) >= len(calls), f"{param.id}: {len(calls)} generating calls, {len(bounds)} bounds"


def _activate() -> Path:
    activate = Path(sys.executable).parent / "activate"
    assert activate.exists(), f"{sys.executable} is not in a venv with an activate script"
    return activate


class _Servers:
    """`pagedllm serve ARGS` as a user starts it, one per distinct ARGS, on free ports."""

    def __init__(self):
        self.running: dict[str, tuple[subprocess.Popen, int]] = {}

    def start(self, command: str) -> tuple[subprocess.Popen, int]:
        port = _free_port()
        log = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen(
            ["bash", "-c", f"source {_activate()} && exec {command} --port {port}"],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc)
        except RuntimeError as e:
            self.stop(proc)
            log.seek(0)
            raise RuntimeError(f"{command}: {e}\n{log.read()[-3000:]}") from None
        return proc, port

    def get(self, command: str) -> int:
        if command not in self.running:
            self.running[command] = self.start(command)
        return self.running[command][1]

    @staticmethod
    def stop(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def stop_all(self) -> None:
        for proc, _ in self.running.values():
            self.stop(proc)


@pytest.fixture(scope="module")
def servers():
    s = _Servers()
    yield s
    s.stop_all()


@pytest.fixture(scope="module", autouse=True)
def _remove_what_the_examples_leave_in_tmp():
    """The pages write under /tmp as a user would (/tmp/pagedllm-llava is 540 MB): once the examples have run,
    each such path they name that was not there before goes, so repeated runs do not fill the disk."""
    named = {Path(m) for page in PAGES for m in re.findall(r"/tmp/pagedllm-[\w.-]+", page.read_text())}
    before = {path for path in named if path.exists()}
    yield
    for path in named - before:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _run(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", f"source {_activate()}\nset -euo pipefail\n{script}"],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
@pytest.mark.parametrize("lang, marker, code", BLOCKS)
def test_example_runs_as_written(lang, marker, code, servers, tmp_path):
    if marker.startswith("skip-ci:"):
        pytest.skip(f"not run in CI: {marker.removeprefix('skip-ci:').strip()}")
    if marker == "test-command":
        pytest.skip("the README's test command: it is what runs this suite")
    if marker.startswith("server:"):
        port = servers.get(marker.removeprefix("server:").strip())
        code = _ADDRESS.sub(rf"\g<1>:{port}", code)
    elif marker:
        pytest.fail(f"unknown example marker {marker!r}: use server: ..., skip-ci: ... or test-command")
    if lang == "python":
        path = tmp_path / "example.py"
        path.write_text(code)
        code = f"python {path}"
    serve = _SERVE_LAST.search(code) if lang == "bash" else None
    if serve:
        before = code[: serve.start("serve")].rstrip().removesuffix("&&").removesuffix(";")
        if before.strip():
            r = _run(before, tmp_path)
            assert r.returncode == 0, f"{before}\n{r.stdout[-2000:]}{r.stderr[-3000:]}"
        proc, _ = servers.start(serve["serve"].replace("\\\n", " "))
        servers.stop(proc)
        return
    r = _run(code, tmp_path)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), "the example printed nothing"


def test_the_site_builds_strict_with_its_generated_pages(tmp_path):
    """mkdocs build --strict: a broken link, a page missing from the nav or a bad generated page fails."""
    mkdocs = Path(sys.executable).parent / "mkdocs"
    r = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-5000:]
    site = tmp_path / "site"
    assert (site / "search" / "search_index.json").stat().st_size > 10_000  # the search box has an index
    assert (site / "img" / "dashboard.png").stat().st_size > 10_000
    svg = (site / "img" / "ratios.svg").read_text()
    assert svg.count("<rect") >= 10 and "llama.cpp" in svg and "transformers" in svg
    from pagedllm.config import EngineConfig

    engine_args = (site / "reference" / "engine-args" / "index.html").read_text()
    missing = [f.name for _, f in EngineConfig.all_fields() if f"<code>{f.name}</code>" not in engine_args]
    assert not missing, f"engine arguments missing from the generated reference: {missing}"
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for flag in ("--port", "--api-key", "--max-tokens", "--lora-modules"):
        assert f"<code>{flag}</code>" in cli, flag
