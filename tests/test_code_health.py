"""Code health: the package has no import cycles (tools/check_imports.py), ruff finds nothing to lint or
reformat, and mypy finds no type error in the package (both configured in pyproject.toml)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKER = ROOT / "tools" / "check_imports.py"


def _checker():
    spec = importlib.util.spec_from_file_location("check_imports", CHECKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_package_has_no_import_cycles():
    r = subprocess.run([sys.executable, str(CHECKER), str(ROOT / "pagedllm")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no import cycles" in r.stdout


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_checker_finds_a_cycle_through_a_function_level_import(tmp_path):
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import helper\n",
            "pkg/b.py": "def helper():\n    from pkg import a\n    return a\n",
            "pkg/c.py": "import pkg.a\n",  # imports into the cycle, not part of it
        },
    )
    cycles = _checker().find_cycles(pkg)
    assert [(comp, [(s, d) for s, d, _ in edges]) for comp, edges in cycles] == [
        (["pkg.a", "pkg.b"], [("pkg.a", "pkg.b"), ("pkg.b", "pkg.a")])
    ]
    r = subprocess.run([sys.executable, str(CHECKER), str(pkg)], capture_output=True, text=True)
    assert r.returncode == 1 and "pkg.b -> pkg.a" in r.stdout


def test_checker_resolves_relative_and_package_imports_and_skips_type_checking(tmp_path):
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from .sub import thing\n",
            "pkg/sub/__init__.py": "from .impl import thing\n",
            "pkg/sub/impl.py": (
                "thing = 1\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import sub\n"
            ),
            "pkg/x.py": "from pkg.sub import impl\n",
            "pkg/y.py": "from . import x\n",
        },
    )
    checker = _checker()
    edges = checker.build_graph(checker.discover(pkg))
    assert set(edges) == {
        ("pkg", "pkg.sub"),
        ("pkg.sub", "pkg.sub.impl"),
        ("pkg.x", "pkg.sub.impl"),
        ("pkg.y", "pkg.x"),
    }
    assert checker.find_cycles(pkg) == []
    # the same import outside TYPE_CHECKING closes a cycle
    (pkg / "sub" / "impl.py").write_text("thing = 1\nfrom pkg import sub\n")
    assert [comp for comp, _ in checker.find_cycles(pkg)] == [["pkg.sub", "pkg.sub.impl"]]


def _tool(name: str) -> str:
    """A tool installed beside this interpreter (the test extra pins ruff and mypy)."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


def test_ruff_finds_nothing_to_lint_or_reformat():
    lint = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout[-5000:] + lint.stderr
    fmt = subprocess.run([_tool("ruff"), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stdout[-5000:] + fmt.stderr


def test_mypy_finds_no_type_error_in_the_package(tmp_path):
    r = subprocess.run(
        [_tool("mypy"), "--cache-dir", str(tmp_path / "mypy-cache")], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr
    assert "Success: no issues found" in r.stdout
