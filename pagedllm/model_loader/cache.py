"""On-disk cache for artifacts derived from a GGUF file (tokenizer, config).

Converting a GGUF's vocabulary into a Hugging Face tokenizer takes seconds, so
the result is saved once and reloaded in milliseconds. Layout::

    $PAGEDLLM_CACHE_DIR (default ~/.cache/pagedllm)/
        tokenizers/<key>/   tokenizer.json, tokenizer_config.json, chat_template.jinja
        configs/<key>/      config.json (every field of transformers' config, defaults included)

``key`` hashes the source file's absolute path, size and mtime plus the library
versions that did the conversion, so an edited file or an upgrade misses.

Invariant: ``<kind>/<key>`` exists only when complete. Writers fill a private
temp dir and ``rename`` it into place (atomic on POSIX), so a concurrent reader
sees either nothing or the whole entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# held while transformers loads a config or tokenizer: the engine loads its tokenizer on a thread of its own
# while the main thread may load a draft model's config, and transformers' lazy imports are not safe from two
# threads at once
TRANSFORMERS_LOADS = threading.RLock()

CACHE_DIR_ENV = "PAGEDLLM_CACHE_DIR"
# Bump when the content written into an entry changes shape.
# 2: configs/ holds the whole config dict of the GGUF, defaults included; 3: tokenizers/ hold the added tokens
# in tokenizer_config.json too (model_loader/tokenizer.py: save_tokenizer)
_FORMAT_VERSION = 3


def cache_root() -> str:
    """``$PAGEDLLM_CACHE_DIR``, else ``~/.cache/pagedllm`` (honouring ``XDG_CACHE_HOME``)."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pagedllm")


def cache_key(source_file: str) -> str:
    """A key that changes whenever the file or the converting libraries change (their versions read from
    the installed metadata: importing transformers costs half a second, which a cache hit need not pay)."""
    from importlib.metadata import version

    path = os.path.abspath(source_file)
    st = os.stat(path)
    ident = [
        _FORMAT_VERSION,
        path,
        st.st_size,
        st.st_mtime_ns,
        version("transformers"),
        version("tokenizers"),
    ]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:32]


def load_or_build(
    kind: str,
    source_file: str,
    build: Callable[[], T],
    save: Callable[[T, str], object],  # what it returns is ignored
    load: Callable[[str], T],
) -> T:
    """Return ``load(entry)`` on a hit; otherwise ``build()``, save it, and return it.

    A cache that cannot be read or written only costs time: errors are logged
    and the freshly built value is returned.
    """
    entry = os.path.join(cache_root(), kind, cache_key(source_file))
    if os.path.isdir(entry):
        try:
            return load(entry)
        except Exception as e:  # a broken entry must not break loading the model
            logger.warning("Ignoring unreadable cache entry %s: %s", entry, e)
            return build()
    logger.info(
        "building the %s cache entry for %s (once; later runs read it from %s)",
        kind.rstrip("s"),
        os.path.basename(source_file),
        os.path.dirname(entry),
    )
    value = build()
    try:
        _write_atomically(entry, lambda tmp: save(value, tmp))
    except Exception as e:  # e.g. a read-only home directory
        logger.warning("Could not write cache entry %s: %s", entry, e)
    return value


def _write_atomically(entry: str, fill: Callable[[str], object]) -> None:
    parent = os.path.dirname(entry)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(entry)}.", suffix=".tmp", dir=parent)
    try:
        fill(tmp)
        try:
            os.rename(tmp, entry)
        except OSError:
            # Another process renamed its copy into place first; theirs is as good.
            if not os.path.isdir(entry):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
