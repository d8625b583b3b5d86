"""Structure checks: the package has no import cycles (tools/check_imports.py)."""

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
