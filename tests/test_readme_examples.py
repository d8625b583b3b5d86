"""Every README block marked `<!-- example -->` runs as written (with small output sizes).

Python blocks run in a fresh interpreter; shell blocks run line by line with this
environment's `pagedllm` on PATH. A block whose marker says it needs `pagedllm serve`
runs against a live server of the default model, on a free port instead of 8000.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from utils import _free_port, wait_healthy

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"<!-- example(?P<note>[^>]*)-->\n```(?P<lang>python|bash)\n(?P<code>.*?)```", re.S)
# small sizes: the examples' own numbers are for people, these keep the suite fast
_SMALL = [(re.compile(r"max_tokens=\d+"), "max_tokens=8"), (re.compile(r"--max-tokens \d+"), "--max-tokens 8")]


def _examples() -> list:
    text = README.read_text()
    found = [
        pytest.param(m["lang"], m["note"], m["code"], id=f"README.md:{text.count(chr(10), 0, m.start()) + 1}")
        for m in _BLOCK.finditer(text)
    ]
    assert len(found) >= 4, "the README's example markers went missing"
    return found


def test_every_python_example_bounds_its_output():
    """Sampling without a bound can run to the context length (minutes): each generating call says how much."""
    for param in _examples():
        lang, _, code = param.values
        if lang == "python":
            calls = re.findall(r"\.(?:generate|chat|create|beam_search)\(", code)
            bounds = re.findall(r"max_tokens=\d+", code)
            assert len(bounds) >= len(calls), f"{param.id}: {len(calls)} generating calls, {len(bounds)} bounds"


def _small(code: str) -> str:
    for pattern, repl in _SMALL:
        code = pattern.sub(repl, code)
    return code


def _env() -> dict[str, str]:
    bin_dir = os.path.dirname(sys.executable)
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PAGEDLLM_LOGGING_LEVEL": "WARNING",
    }


@pytest.fixture(scope="module")
def default_server():
    """`pagedllm serve` of the default model, as the README starts it, on a free port."""
    port = _free_port()
    proc = subprocess.Popen(
        [
            os.path.join(os.path.dirname(sys.executable), "pagedllm"),
            "serve",
            "--port",
            str(port),
            "--uvicorn-log-level",
            "warning",
        ],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_healthy(f"http://127.0.0.1:{port}", proc)
    yield port
    proc.terminate()
    proc.wait(30)


@pytest.mark.slow
@pytest.mark.parametrize("lang, note, code", _examples())
def test_readme_example_runs_as_written(lang, note, code, request, tmp_path):
    code = _small(code)
    if "pagedllm serve" in note:
        code = code.replace("127.0.0.1:8000", f"127.0.0.1:{request.getfixturevalue('default_server')}")
    if lang == "python":
        r = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.strip(), "the example printed nothing"
        return
    for line in code.splitlines():
        command = re.sub(r"\s+#.*$", "", line).strip()
        if command:
            r = subprocess.run(
                ["bash", "-c", command], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
            )
            assert r.returncode == 0, f"{command}: {r.stderr[-3000:]}"
            assert r.stdout.strip(), f"{command} printed nothing"
