"""MooncakeConnector: a prefill engine's KV blocks read straight into a decode engine's cache over the network,
with Mooncake's Transfer Engine (the library vLLM's MooncakeConnector uses), as vLLM's P/D protocol runs it::

    proxy ──request + kv_transfer_params {"do_remote_decode": true}──► producer (kv_producer)
          ◄──one token + kv_transfer_params {where its blocks are}───  computes the prompt, holds its blocks
    proxy ──request + those kv_transfer_params────────────────────────► consumer (kv_consumer)
          consumer: allocates blocks, reads the producer's into them (one batched read), releases them on
                    the producer's side channel, computes the prompt's last token, streams the answer

Each engine registers its whole KV cache buffer with its Transfer Engine once, at start-up
(``[layers, 2, blocks, block_size, kv_heads, head_dim]``, one allocation): a block of a layer's K or V is one
contiguous range, at the same offset rule on both sides, so the consumer reads it by address.

**The producer** (scheduler half) keeps a finished prefill's blocks referenced (the block pool's
:meth:`~pagedllm.core.kv_cache_manager.KVCacheManager.hold`) until the consumer releases them, or
``hold_timeout_s`` passes (then frees them and counts it). Its side channel is a small TCP server in the
engine process: one JSON line in (``{"release": request id, "engine_id": …}``), one out (``{"held": bool}``).

**The consumer** counts the remote blocks as computed at admission (all but the prompt's last token, which it
computes to sample from), and its worker half reads them before the step's forward. Then it releases them;
the producer's answer says whether they stayed held throughout the read. A read that failed (the producer died,
an address it refused) or a release that says otherwise (the hold timed out and the blocks may have been
reused) marks the blocks failed: the scheduler drops the step's output for that request and recomputes its
prompt locally (:meth:`Scheduler.handle_kv_load_failures`). A request tries a producer once.

Both ends must lay their cache out alike (model files, layers, block size, KV heads and dtype): a request whose
``kv_transfer_params`` describe another layout is refused with a 400 naming the difference. One rank per engine
(tensor and pipeline parallelism are refused at start-up).

Security: the Transfer Engine's RPC port listens on every interface, without authentication, and serves any
registered memory (the KV cache) to whoever asks; the side channel binds ``host``. Both belong on a private
network between the engines.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import socketserver
import threading
import time
import uuid
from array import array
from typing import Any

import torch

from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.errors import InvalidParameterError
from pagedllm.kv_transfer.config import MooncakeOptions
from pagedllm.kv_transfer.metadata import KVConnectorMetadata, KVConnectorStats, RemotePull
from pagedllm.request import Request, RequestStatus

logger = logging.getLogger("pagedllm")

MAX_TOKENS = 1 << 24  # bounds on a request's kv_transfer_params (a prompt's tokens, a producer's blocks)
MAX_BLOCKS = 1 << 26
MAX_HELD_FRACTION = 0.5  # of a producer's KV cache, at most, held for consumers (past it: no params, no hold)
MAX_BATCH = 1024  # ranges per batched read: the Transfer Engine fails larger batches (measured: 2,000 pass, 4,000 fail)

# what a producer's answer carries (vLLM's names where it has one), beside do_remote_prefill
_REMOTE_KEYS = {
    "remote_engine_id": str,
    "remote_host": str,
    "remote_port": int,
    "remote_side_channel_port": int,
    "remote_request_id": str,
    "remote_block_ids": list,
    "remote_num_tokens": int,
    "remote_tokens_sha256": str,
    "remote_base": int,
    "remote_num_blocks": int,
    "remote_layout": dict,
}


def tokens_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()


def where_digest(block_ids: list[int], base: int, num_blocks: int) -> str:
    """Names the memory a consumer reads: the producer releases a hold only to a consumer that read the blocks
    it holds (a client's own kv_transfer_params cannot point a consumer at another request's blocks)."""
    return hashlib.sha256(json.dumps([list(block_ids), base, num_blocks]).encode()).hexdigest()


def check_kv_transfer_params(params: Any, role: str | None, layout: dict | None) -> None:
    """A request's ``kv_transfer_params``: a 400 naming the field where they cannot be used here."""
    where = "kv_transfer_params"
    if params is None:
        return
    if not isinstance(params, dict):
        raise InvalidParameterError(f"{where} must be a JSON object", where)
    if role is None:
        raise InvalidParameterError(f"{where} needs a KV connector (--kv-transfer-config)", where)
    known = {"do_remote_decode", "do_remote_prefill", *_REMOTE_KEYS}
    if unknown := sorted(set(params) - known):
        raise InvalidParameterError(f"{where}: unknown keys {unknown}", f"{where}.{unknown[0]}")
    for flag in ("do_remote_decode", "do_remote_prefill"):
        if not isinstance(params.get(flag, False), bool):
            raise InvalidParameterError(f"{where}.{flag} must be true or false", f"{where}.{flag}")
    if params.get("do_remote_decode") and role == "kv_consumer":
        raise InvalidParameterError(
            f"{where}.do_remote_decode: this engine is a kv_consumer", f"{where}.do_remote_decode"
        )
    if not params.get("do_remote_prefill"):
        return
    if role == "kv_producer":
        raise InvalidParameterError(
            f"{where}.do_remote_prefill: this engine is a kv_producer", f"{where}.do_remote_prefill"
        )
    if layout is None:
        raise InvalidParameterError(
            f"{where}.do_remote_prefill needs the MooncakeConnector on this engine", f"{where}.do_remote_prefill"
        )
    for key, kind in _REMOTE_KEYS.items():
        value = params.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            shown = repr(value)[:80]
            raise InvalidParameterError(f"{where}.{key} must be a {kind.__name__}, got {shown}", f"{where}.{key}")
    theirs = params["remote_layout"]
    for key in sorted(set(layout) | set(theirs), key=str)[:32]:
        if theirs.get(key) != layout.get(key):
            raise InvalidParameterError(
                f"{where}.remote_layout: the prefill engine's KV cache differs from this engine's in {str(key)[:40]} "
                f"({repr(theirs.get(key))[:80]} there, {layout.get(key)!r} here): both must run the same model files "
                "with the same block size, KV dtype and parallelism",
                f"{where}.remote_layout",
            )
    # the numbers become addresses this engine reads from: each within what a producer with this layout has
    n, blocks = params["remote_num_tokens"], params["remote_num_blocks"]
    if not 1 <= n <= MAX_TOKENS:
        raise InvalidParameterError(
            f"{where}.remote_num_tokens must be 1 to {MAX_TOKENS}", f"{where}.remote_num_tokens"
        )
    if not 1 <= blocks <= MAX_BLOCKS:
        raise InvalidParameterError(
            f"{where}.remote_num_blocks must be 1 to {MAX_BLOCKS}", f"{where}.remote_num_blocks"
        )
    ids = params["remote_block_ids"]
    if len(ids) != -(-n // layout["block_size"]):
        raise InvalidParameterError(
            f"{where}.remote_block_ids must hold one block per {layout['block_size']} of the remote_num_tokens",
            f"{where}.remote_block_ids",
        )
    if not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < blocks for b in ids):
        raise InvalidParameterError(
            f"{where}.remote_block_ids must be block numbers below remote_num_blocks", f"{where}.remote_block_ids"
        )
    itemsize = torch.empty((), dtype=getattr(torch, layout["kv_dtype"])).element_size()
    cache = layout["layers"] * 2 * blocks * layout["block_size"] * layout["kv_heads"] * layout["head_dim"] * itemsize
    if not 0 < params["remote_base"] < (1 << 64) - cache:
        raise InvalidParameterError(f"{where}.remote_base is not an address", f"{where}.remote_base")
    for key in ("remote_port", "remote_side_channel_port"):
        if not 1 <= params[key] <= 65535:
            raise InvalidParameterError(f"{where}.{key} must be a port number", f"{where}.{key}")
    for key in ("remote_host", "remote_engine_id", "remote_request_id", "remote_tokens_sha256"):
        if not 0 < len(params[key]) <= 256:
            raise InvalidParameterError(f"{where}.{key} must be 1 to 256 characters", f"{where}.{key}")


class _Holds:
    """The producer's held requests, shared by the engine thread and the side channel's threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.deadline: dict[str, float] = {}  # hold id -> when it times out
        self.where: dict[str, str] = {}  # hold id -> its where_digest
        self.released: list[str] = []  # released by a consumer, to free on the engine thread

    def release(self, rid: str, where: str) -> bool:
        """True when these very blocks were held until now (so a read that came before saw them whole)."""
        with self.lock:
            if rid not in self.deadline or self.where.get(rid) != where:
                return False
            del self.deadline[rid], self.where[rid]
            self.released.append(rid)
            return True


class _SideChannel(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], engine_id: str, holds: _Holds):
        self.engine_id = engine_id
        self.holds = holds
        super().__init__(address, _SideChannelHandler)


class _SideChannelHandler(socketserver.StreamRequestHandler):
    timeout = 10

    def handle(self) -> None:
        server = self.server
        assert isinstance(server, _SideChannel)
        try:
            msg = json.loads(self.rfile.readline(4096))
            rid, engine, where = msg["release"], msg["engine_id"], msg["where"]
        except (ValueError, KeyError, TypeError, OSError, RecursionError):
            return
        held = engine == server.engine_id and isinstance(rid, str) and server.holds.release(rid, where)
        try:
            self.wfile.write(json.dumps({"held": held}).encode() + b"\n")
        except OSError:
            pass


def release_remote(address: tuple[str, int], engine_id: str, rid: str, where: str, timeout: float = 5.0) -> bool:
    """Release a request's blocks on its producer: True when they were held until now."""
    try:
        with socket.create_connection(address, timeout=timeout) as s:
            s.sendall(json.dumps({"release": rid, "engine_id": engine_id, "where": where}).encode() + b"\n")
            answer = s.makefile("rb").readline(4096)
        return json.loads(answer).get("held") is True
    except (OSError, ValueError, AttributeError, OverflowError) as e:
        logger.warning("MooncakeConnector: could not release %s on %s:%d (%s)", rid, *address, e)
        return False


class MooncakeScheduler:
    """The scheduler half (engine process): a producer's holds and side channel, a consumer's pull plans."""

    def __init__(
        self, role: str, options: MooncakeOptions, block_size: int, block_bytes: int, worker: dict, layout: dict
    ):
        self.options = options
        self.block_size = block_size
        self.block_bytes = block_bytes  # one block, every layer's K and V
        self.worker = worker  # the worker half's transfer engine: rpc_port, base, num_blocks
        self.layout = layout
        self.engine_id = uuid.uuid4().hex
        self.kv: Any = None  # the KVCacheManager, bound by the scheduler
        self.stats = KVConnectorStats()
        self._meta = KVConnectorMetadata()
        self._tried: set[str] = set()  # consumer: requests that used (or gave up) their producer's blocks
        self._holds = _Holds()
        self._held_bytes: dict[str, int] = {}
        self._server: _SideChannel | None = None
        if role in ("kv_producer", "kv_both"):
            try:
                self._server = _SideChannel((options.host, options.side_channel_port), self.engine_id, self._holds)
            except OSError as e:
                raise InvalidParameterError(
                    f"kv_transfer_config: MooncakeConnector's side channel cannot listen on "
                    f"{options.host}:{options.side_channel_port}: {e}",
                    "kv_transfer_config.kv_connector_extra_config.side_channel_port",
                ) from None
            threading.Thread(target=self._server.serve_forever, name="mooncake-side-channel", daemon=True).start()
            logger.info(
                "MooncakeConnector (%s): transfer engine %s:%d, side channel %s:%d; both must be on a private network",
                role,
                options.host,
                worker["rpc_port"],
                *self._server.server_address[:2],
            )
        else:
            logger.info("MooncakeConnector (%s): transfer engine %s:%d", role, options.host, worker["rpc_port"])

    def bind(self, kv: Any) -> None:
        self.kv = kv

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # -- consumer ---------------------------------------------------------------------------------------------
    def _remote(self, request: Request) -> dict | None:
        """The producer's answer this request brought, if it has not used it yet. Under n > 1 the first
        completion uses it; the others fork off its blocks (or, with no room to fork, compute the prompt)."""
        extra = request.sampling_params.extra_args or {}
        params = extra.get("kv_transfer_params")
        if not params or not params.get("do_remote_prefill") or request.index or request.request_id in self._tried:
            return None
        return params

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        params = self._remote(request)
        if params is None or request.num_output_tokens or request.sampling_params.prompt_logprobs is not None:
            return 0
        n = request.num_prompt_tokens
        if params["remote_num_tokens"] != n or params["remote_tokens_sha256"] != tokens_digest(
            request.prompt_token_ids
        ):
            return 0  # not the prompt the producer computed (another tokenizer or chat template): compute it here
        return max(0, n - 1 - num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_computed_tokens: int, num_external_tokens: int
    ) -> None:
        params = self._remote(request)
        if params is None:
            return
        self._tried.add(request.request_id)
        bs = self.block_size
        first = num_computed_tokens // bs
        last = -(-(num_computed_tokens + num_external_tokens) // bs)  # the partial last block included
        remote = params["remote_block_ids"]
        pull = self._pull(
            params, [(remote[i], block_ids[i]) for i in range(first, last)] if num_external_tokens else []
        )
        self._meta.remote_pulls.append(pull)
        if pull.blocks:
            self.stats.remote_pulls += 1
            self.stats.remote_bytes_pulled += len(pull.blocks) * self.block_bytes
            self.stats.queries += request.num_tokens - num_computed_tokens
            self.stats.hits += num_external_tokens

    def _pull(self, params: dict, blocks: list[tuple[int, int]]) -> RemotePull:
        return RemotePull(
            f"{params['remote_host']}:{params['remote_port']}",
            (params["remote_host"], params["remote_side_channel_port"]),
            params["remote_engine_id"],
            params["remote_request_id"],
            params["remote_base"],
            params["remote_num_blocks"],
            where_digest(params["remote_block_ids"], params["remote_base"], params["remote_num_blocks"]),
            blocks,
        )

    def on_load_failed(self, block_hashes: list[bytes | None]) -> None:
        self.stats.remote_pull_failures += 1

    # -- producer ---------------------------------------------------------------------------------------------
    def request_finished(self, request: Request) -> None:
        rid = request.request_id
        if (params := self._remote(request)) is not None:  # a consumer's request that never ran: free the producer's
            self._tried.add(rid)
            self._meta.remote_pulls.append(self._pull(params, []))
        self._tried.discard(rid)
        extra = request.sampling_params.extra_args or {}
        ask = extra.get("kv_transfer_params") or {}
        n = request.num_prompt_tokens
        if (
            not ask.get("do_remote_decode")
            or self._server is None
            or request.status == RequestStatus.FINISHED_ABORTED
            or request.num_computed_tokens < n
            or request.index  # n>1: the first completion's blocks hold the prompt
        ):
            return
        blocks: list[KVCacheBlock] = self.kv.req_blocks[rid][: -(-n // self.block_size)]
        held = sum(len(b) for b in self.kv.holds.values())
        if held + len(blocks) > self.kv.num_blocks * MAX_HELD_FRACTION:
            logger.warning(
                "MooncakeConnector: %d of %d blocks already wait for consumers; %s's are not held (its decode "
                "engine computes the prompt)",
                held,
                self.kv.num_blocks,
                rid,
            )
            return
        hold = f"{rid}@{uuid.uuid4().hex[:12]}"  # request ids may come back (offline ones, a client's own)
        self.kv.hold(hold, blocks)
        ids = [b.block_id for b in blocks]
        with self._holds.lock:
            self._holds.deadline[hold] = time.monotonic() + self.options.hold_timeout_s
            self._holds.where[hold] = where_digest(ids, self.worker["base"], self.worker["num_blocks"])
        self._held_bytes[hold] = len(blocks) * self.block_bytes
        request.kv_transfer_params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.options.host,
            "remote_port": self.worker["rpc_port"],
            "remote_side_channel_port": self._server.server_address[1],
            "remote_request_id": hold,
            "remote_block_ids": ids,
            "remote_num_tokens": n,
            "remote_tokens_sha256": tokens_digest(request.prompt_token_ids),
            "remote_base": self.worker["base"],
            "remote_num_blocks": self.worker["num_blocks"],
            "remote_layout": self.layout,
        }

    def start_step(self) -> None:
        """Free the holds consumers released, and those past their timeout (engine thread)."""
        now = time.monotonic()
        with self._holds.lock:
            released, self._holds.released = self._holds.released, []
            expired = [rid for rid, t in self._holds.deadline.items() if t <= now]
            for rid in expired:
                del self._holds.deadline[rid], self._holds.where[rid]
        for rid in released:
            self.kv.release_hold(rid)
            self.stats.remote_bytes_served += self._held_bytes.pop(rid)
        for rid in expired:
            logger.warning(
                "MooncakeConnector: no consumer pulled %s's blocks in %gs; freed", rid, self.options.hold_timeout_s
            )
            self.kv.release_hold(rid)
            self._held_bytes.pop(rid)
            self.stats.remote_hold_timeouts += 1

    def idle_wake_s(self) -> float | None:
        """While blocks are held, the engine wakes this often even when idle, to free them."""
        return 0.5 if self._held_bytes else None

    # -- the interface's other hooks ------------------------------------------------------------------------------
    def on_primary_evict(self, block_id: int, block_hash: bytes) -> None:
        pass

    def on_preempt(self, request: Request, block_ids: list[int]) -> None:
        pass

    def on_scheduled(self, request: Request, blocks: list[KVCacheBlock], start: int, num_tokens: int) -> None:
        pass

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta or None

    def has_pending(self) -> bool:
        if self._meta:
            return True
        with self._holds.lock:
            return bool(self._holds.released) or any(t <= time.monotonic() for t in self._holds.deadline.values())

    def take_stats(self) -> KVConnectorStats:
        self.stats.remote_pending = len(self._held_bytes)
        return self.stats.take()

    def check_invariants(self) -> None:
        held = set(self.kv.holds)
        assert held == set(self._held_bytes), f"held blocks {sorted(held)} != holds {sorted(self._held_bytes)}"


class MooncakeWorker:
    """The worker half: this rank's Transfer Engine, its KV cache buffer registered, and the reads."""

    def __init__(self, kv_caches: list[torch.Tensor], options: MooncakeOptions):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise InvalidParameterError(
                f"kv_transfer_config: MooncakeConnector needs Mooncake's Transfer Engine ({e}): pip install "
                "mooncake-transfer-engine-non-cuda (or mooncake-transfer-engine with CUDA), and on Debian or Ubuntu "
                "apt-get install libibverbs1",
                "kv_transfer_config.kv_connector",
            ) from None
        self.kv_caches = kv_caches
        c = kv_caches[0]
        if c.device.type != "cpu":
            raise InvalidParameterError(
                f"kv_transfer_config: MooncakeConnector reads KV caches in CPU memory only so far; this one is on "
                f"{c.device}",
                "kv_transfer_config.kv_connector",
            )
        self.num_blocks = c.shape[1]
        self.block_bytes = c[0, 0].numel() * c.element_size()  # one layer's K (or V) of one block
        self.layer_bytes = 2 * self.num_blocks * self.block_bytes
        self.base = c.data_ptr()
        for layer, cache in enumerate(kv_caches):  # one buffer, layer after layer (worker.kv_cache)
            assert cache.is_contiguous() and cache.data_ptr() == self.base + layer * self.layer_bytes
        self.engine = TransferEngine()
        if self.engine.initialize(options.host, "P2PHANDSHAKE", options.protocol, "") != 0:
            raise RuntimeError(
                f"MooncakeConnector: the Transfer Engine did not start on {options.host} ({options.protocol})"
            )
        size = len(kv_caches) * self.layer_bytes
        if self.engine.register_memory(self.base, size) != 0:
            raise RuntimeError(f"MooncakeConnector: could not register the KV cache ({size} bytes)")
        self.save_seconds = self.load_seconds = 0.0
        self.failed: list[int] = []

    def info(self) -> dict:
        return {"rpc_port": self.engine.get_rpc_port(), "base": self.base, "num_blocks": self.num_blocks}

    def _ranges(self, pull: RemotePull) -> tuple[list[int], list[int], list[int]]:
        """(local addresses, remote addresses, lengths): a run of consecutive blocks on both sides is one range
        per layer and K / V."""
        runs: list[list[int]] = []  # [remote first, local first, count]
        for remote, local in sorted(pull.blocks, key=lambda b: b[1]):
            if runs and runs[-1][0] + runs[-1][2] == remote and runs[-1][1] + runs[-1][2] == local:
                runs[-1][2] += 1
            else:
                runs.append([remote, local, 1])
        bb, layers = self.block_bytes, len(self.kv_caches)
        mine, theirs, lens = [], [], []
        for layer in range(layers):
            for kv in range(2):
                for remote, local, count in runs:
                    mine.append(self.base + layer * self.layer_bytes + (kv * self.num_blocks + local) * bb)
                    theirs.append(pull.base + ((layer * 2 + kv) * pull.num_blocks + remote) * bb)
                    lens.append(count * bb)
        return mine, theirs, lens

    def execute(self, meta: KVConnectorMetadata) -> None:
        t0 = time.perf_counter()
        for pull in meta.remote_pulls:
            ok = True
            if pull.blocks:
                try:
                    ok = self._read(pull)
                except Exception as e:  # whatever a peer (or a request's parameters) does, the engine goes on
                    logger.warning("MooncakeConnector: reading %s's blocks failed: %s", pull.remote_request_id, e)
                    ok = False
                if not ok:
                    logger.warning(
                        "MooncakeConnector: reading %s's blocks from %s failed", pull.remote_request_id, pull.session
                    )
            held = release_remote(pull.side_channel, pull.engine_id, pull.remote_request_id, pull.where)
            if pull.blocks and ok and not held:
                logger.warning(
                    "MooncakeConnector: %s's blocks were no longer held on %s (timed out?); recomputing",
                    pull.remote_request_id,
                    pull.session,
                )
            if pull.blocks and not (ok and held):
                self.failed += [local for _, local in pull.blocks]
        self.load_seconds += time.perf_counter() - t0

    def _read(self, pull: RemotePull) -> bool:
        mine, theirs, lens = self._ranges(pull)
        return all(  # (a batch of more than a few thousand ranges is refused by the engine: -1)
            self.engine.batch_transfer_sync_read(
                pull.session, mine[i : i + MAX_BATCH], theirs[i : i + MAX_BATCH], lens[i : i + MAX_BATCH]
            )
            == 0
            for i in range(0, len(lens), MAX_BATCH)
        )

    def after_forward(self, meta: KVConnectorMetadata) -> None:
        pass  # (a consumer only reads)

    def take_times(self) -> tuple[float, float]:
        out = (self.save_seconds, self.load_seconds)
        self.save_seconds = self.load_seconds = 0.0
        return out
