"""The optional packages and programs a bench needs, checked before it loads any model.

`pagedllm bench latency` once ran 4.5 minutes of pagedllm, then died loading transformers' side of the
comparison (``accelerate is required when loading a GGUF file``) and took the pagedllm half's results with it.
Each bench now asks for what it will need first: a missing package (looked up with
``importlib.util.find_spec``, which imports nothing) or program ends it with one line naming it and the fix.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

BENCH_EXTRA = 'pip install -e ".[bench]"'


def require(what: str, module: str, fix: str, why: str = "") -> None:
    """Exit unless ``module`` (a top-level name) is installed, saying ``{what}, which needs {module} {why}: {fix}``
    (``what``: the bench and the part that needs it)."""
    if importlib.util.find_spec(module) is None:
        raise SystemExit(f"{what}, which needs {module}{f' {why}' if why else ''}: {fix}")


def require_any(what: str, modules: tuple[str, ...], fix: str) -> None:
    """As :func:`require`, where any one of ``modules`` will do."""
    if all(importlib.util.find_spec(m) is None for m in modules):
        raise SystemExit(f"{what}, which needs {' or '.join(modules)}: {fix}")


def require_program(what: str, program: str, fix: str) -> str:
    """The path of ``program`` (a path, or a name on PATH), or exit saying it is missing and how to get it."""
    found = shutil.which(program)
    if found is None or not os.access(found, os.X_OK):
        raise SystemExit(f"{what}, which needs {program}, but no such program was found: {fix}")
    return found


def require_transformers_for(model: str | None, what: str) -> None:
    """transformers loading ``model`` (None: the default model): a GGUF needs accelerate."""
    from pagedllm.model_loader import resolve_model

    if resolve_model(model).kind == "gguf":
        require(what, "accelerate", BENCH_EXTRA, "to load a GGUF")
