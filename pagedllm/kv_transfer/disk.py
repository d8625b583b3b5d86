"""The disk tier: one file per KV block and rank, under ``<path>/<model fingerprint>/``.

A file is a small header and the block's K and V for every layer of the rank::

    b"PGKV1\\n" | 4-byte header length | header JSON | payload ([layers, 2, block_size, kv_heads, head_dim])

The header names the model fingerprint, the block hash, the rank and the
layout (shape and dtype) and carries the payload's CRC-32. Files are written
to a temporary name and renamed into place, so a reader sees a whole file or
none; a crash mid-write leaves a temporary file that is never read (and is
removed at the next start). A block is used only after its header matches
this engine exactly and its checksum holds, on every rank: anything else is
refused, deleted and recomputed.

The directory is the cache: it survives a restart, and its index is rebuilt
from the file names (oldest first) at start. ``max_size_gb`` bounds it, least
recently used deleted first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("pagedllm")

MAGIC = b"PGKV1\n"


def model_fingerprint(source_path: str, identity: dict[str, Any]) -> str:
    """Names the KV a model computes: its files (names, sizes, first and last MiB of each: weights in any
    format, config) and everything else that changes the cached values (dtype, KV dtype, quantization, block
    size, parallelism)."""
    h = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
    p = Path(source_path)
    files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:32]


def _file(root: Path, block_hash: bytes, rank: int) -> Path:
    return root / f"{block_hash.hex()}.r{rank}"


def encode(fingerprint: str, block_hash: bytes, rank: int, data: torch.Tensor) -> bytes:
    payload = data.contiguous().view(torch.uint8).numpy().tobytes()
    header = json.dumps(
        {
            "fingerprint": fingerprint,
            "hash": block_hash.hex(),
            "rank": rank,
            "shape": list(data.shape),
            "dtype": str(data.dtype).removeprefix("torch."),
            "nbytes": len(payload),
            "crc32": zlib.crc32(payload),
        }
    ).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + payload


def decode(
    raw: bytes, fingerprint: str, block_hash: bytes, rank: int, shape: list[int], dtype: torch.dtype
) -> torch.Tensor | None:
    """The payload as a tensor, or None if anything about the file is not what this engine would write."""
    if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + 4:
        return None
    (n,) = struct.unpack_from("<I", raw, len(MAGIC))
    start = len(MAGIC) + 4 + n
    try:
        header = json.loads(raw[len(MAGIC) + 4 : start])
    except (ValueError, UnicodeDecodeError):
        return None
    payload = raw[start:]
    expected = {
        "fingerprint": fingerprint,
        "hash": block_hash.hex(),
        "rank": rank,
        "shape": list(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "nbytes": len(payload),
    }
    if not isinstance(header, dict) or any(header.get(k) != v for k, v in expected.items()):
        return None
    if header.get("crc32") != zlib.crc32(payload):
        return None
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(shape)


class DiskIndex:
    """Scheduler half: which hashes the directory holds (LRU order), and the size bound."""

    def __init__(
        self,
        path: str,
        fingerprint: str,
        world_size: int,
        block_bytes: int,
        max_bytes: int,
        layouts: list[tuple[list[int], torch.dtype]],
        role: str = "kv_both",
    ):
        self.saves = role in ("kv_both", "kv_producer")  # a producer only writes, a consumer only reads
        self.loads = role in ("kv_both", "kv_consumer")
        self.root = Path(path) / fingerprint
        self.root.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.world_size = world_size
        self.block_bytes = block_bytes  # all ranks' files of one block
        self.max_blocks = max(1, max_bytes // block_bytes)
        self.layouts = layouts  # per rank: (shape, dtype) of a block's payload
        # hash -> the (inode, mtime, size) of every rank's file when last checked, or None (not checked yet)
        self.lru: OrderedDict[bytes, tuple | None] = OrderedDict()
        found: dict[bytes, tuple[int, float]] = {}
        for f in self.root.iterdir():
            if f.name.startswith("."):  # a temporary file a crash left behind
                f.unlink(missing_ok=True)
                continue
            stem = f.name.partition(".r")[0]
            try:
                h = bytes.fromhex(stem)
            except ValueError:
                continue
            n, t = found.get(h, (0, 0.0))
            found[h] = (n + 1, max(t, f.stat().st_mtime))
        for h, _ in sorted(((h, t) for h, (n, t) in found.items() if n == world_size), key=lambda x: x[1]):
            self.lru[h] = None
        self.deletes: list[bytes] = []  # hashes to delete on every rank with this step
        while len(self.lru) > self.max_blocks:
            self.deletes.append(self.lru.popitem(last=False)[0])
        if self.lru:
            logger.info("KV disk tier: %d blocks found in %s", len(self.lru), self.root)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.lru

    def find(self, block_hash: bytes, pinned: set[bytes]) -> bool:
        """Known, or written since by another engine sharing the directory (a prefill engine, a replica):
        a lookup's first miss costs one stat."""
        if block_hash in self.lru:
            return True
        if not all(_file(self.root, block_hash, r).exists() for r in range(self.world_size)):
            return False
        return self.add(block_hash, pinned)

    def verify(self, block_hash: bytes) -> bool:
        """Every rank's file of the block is whole and made by this engine; else it is dropped. A file is read
        again only if it changed since its last check (another engine sharing the directory may have deleted
        or replaced it): a lookup of a checked block costs a stat per rank."""
        files = [_file(self.root, block_hash, rank) for rank in range(self.world_size)]
        try:
            ident = tuple((st.st_ino, st.st_mtime_ns, st.st_size) for st in (f.stat() for f in files))
        except OSError:
            ident = None
        if ident is not None and self.lru[block_hash] == ident:
            return True
        for rank, (shape, dtype) in enumerate(self.layouts):
            try:
                raw = files[rank].read_bytes() if ident is not None else b""
            except OSError:
                raw = b""
            if decode(raw, self.fingerprint, block_hash, rank, shape, dtype) is None:
                logger.warning(
                    "KV disk tier: block %s (rank %d) is missing, torn or not this model's; recomputing it",
                    block_hash.hex()[:16],
                    rank,
                )
                self.drop(block_hash)
                return False
        self.lru[block_hash] = ident
        return True

    def touch(self, block_hash: bytes) -> None:
        self.lru.move_to_end(block_hash)

    def add(self, block_hash: bytes, pinned: set[bytes]) -> bool:
        """Register a block about to be written; makes room by deleting the oldest unpinned ones."""
        while len(self.lru) >= self.max_blocks:
            victim = next((h for h in self.lru if h not in pinned), None)
            if victim is None:
                return False
            self.drop(victim)
        self.lru[block_hash] = None  # checked when first read: the write may yet fail (disk full)
        return True

    def drop(self, block_hash: bytes) -> None:
        if block_hash in self.lru:
            del self.lru[block_hash]
            self.deletes.append(block_hash)


class DiskStore:
    """Worker half: reads and writes this rank's files."""

    def __init__(self, path: str, fingerprint: str, rank: int):
        self.root = Path(path) / fingerprint
        self.root.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.rank = rank

    def delete(self, block_hash: bytes) -> None:
        _file(self.root, block_hash, self.rank).unlink(missing_ok=True)

    def write(self, block_hash: bytes, data: torch.Tensor) -> bool:
        """Atomically (a temporary file, renamed); False if the disk refused (full, read-only): the block is
        then not cached, and the request it came from is not affected."""
        final = _file(self.root, block_hash, self.rank)
        tmp = self.root / f".{final.name}.{os.getpid()}.tmp"
        try:
            tmp.write_bytes(encode(self.fingerprint, block_hash, self.rank, data))
            os.replace(tmp, final)
            return True
        except OSError as e:
            logger.warning("KV disk tier: could not save a block (%s); continuing without it", e)
            tmp.unlink(missing_ok=True)
            return False

    def read(self, block_hash: bytes, shape: list[int], dtype: torch.dtype) -> torch.Tensor | None:
        try:
            raw = _file(self.root, block_hash, self.rank).read_bytes()
        except OSError:
            return None
        return decode(raw, self.fingerprint, block_hash, self.rank, shape, dtype)
