"""The StructuredOutputManager: grammars compiled off the engine loop, one bitmask per step (see the package's
docstring for the flow)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.errors import InvalidParameterError
from pagedllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagedllm.core.scheduler import SchedulerOutput
    from pagedllm.request import Request
    from pagedllm.structured_output.guidance_backend import GuidanceBackend
    from pagedllm.structured_output.xgrammar_backend import XgrammarBackend
    from pagedllm.worker.runner_output import ModelRunnerOutput

logger = logging.getLogger("pagedllm")


def allow_only(mask: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """Every row of an int32 bitmask allowing exactly ``token_ids``."""
    mask.zero_()
    for t in token_ids:
        bit = t % 32
        mask[:, t // 32] |= (1 << bit) if bit < 31 else -(1 << 31)
    return mask


def _failed(fut: Future) -> bool:
    return fut.done() and (fut.cancelled() or fut.exception() is not None)


MAX_PENDING_COMPILES = 32  # distinct grammars queued or compiling; more is refused (each may take seconds)

BACKENDS = ("xgrammar", "guidance", "auto")
_MODULES = {"xgrammar": "xgrammar", "guidance": "llguidance"}


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        backend: str = "xgrammar",
        compile_timeout: float = 30.0,
    ):
        if backend not in BACKENDS:
            raise InvalidParameterError(
                f"structured outputs backend must be one of {list(BACKENDS)}, got {backend!r}",
                "structured_outputs_config.backend",
            )
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.compile_timeout = compile_timeout
        self.backend_name = backend
        self._backends: dict[str, Any] = {}
        self.backend_init_seconds: dict[str, float] = {}  # the one-time set-up (the vocabulary's token index)
        self._lock = threading.Lock()  # the caches (never held while a backend sets up or a grammar compiles)
        self._init_lock = threading.Lock()  # backend set-up (llguidance's takes seconds)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self._compiled: OrderedDict[str, Future] = OrderedDict()  # spec -> compiled grammar, shared; LRU
        self._validated: OrderedDict[str, None] = OrderedDict()  # specs parsed recently (an LRU set)
        self.matchers: dict[str, tuple[Any, Any]] = {}  # request id -> (backend, its matcher)
        self._pending: dict[str, tuple[Future, float]] = {}  # request id -> (compile, submit time)
        # stats: cumulative, and the events not yet taken by a metrics exporter (take_events)
        self.num_constrained_requests = 0
        self.compile_seconds: list[tuple[float, bool]] = []  # (seconds, cache hit) per compile asked for
        self._events: deque[tuple[float, bool] | None] = deque()  # None: a constrained request arrived

    def _backend(self, name: str) -> Any:
        backend = self._backends.get(name)
        if backend is not None:
            return backend
        with self._init_lock:
            if name not in self._backends:
                import importlib

                try:
                    importlib.import_module(_MODULES[name])
                except ImportError:
                    raise InvalidParameterError(
                        f"structured outputs with the {name} backend need {_MODULES[name]}, which is not installed: "
                        f"pip install 'pagedllm[structured]'",
                        "structured_outputs",
                    ) from None
                cls: type[XgrammarBackend] | type[GuidanceBackend]
                if name == "xgrammar":
                    from pagedllm.structured_output.xgrammar_backend import XgrammarBackend as cls
                else:
                    from pagedllm.structured_output.guidance_backend import GuidanceBackend as cls
                t0 = time.perf_counter()
                self._backends[name] = cls(self.tokenizer, self.vocab_size, self.eos_token_ids)
                self.backend_init_seconds[name] = time.perf_counter() - t0
            return self._backends[name]

    def _parse(self, so: StructuredOutputsParams) -> tuple[Any, Any]:
        """(backend, grammar) for a spec; ``auto`` tries xgrammar, then llguidance."""
        if self.backend_name != "auto":
            backend = self._backend(self.backend_name)
            return backend, backend.grammar(so)
        try:
            backend = self._backend("xgrammar")
            return backend, backend.grammar(so)
        except InvalidParameterError as first:
            try:
                backend = self._backend("guidance")
                return backend, backend.grammar(so)
            except InvalidParameterError:
                raise first from None

    # -- before the engine: validation (400 on a bad spec) ----------------------------------
    def validate(self, so: StructuredOutputsParams) -> None:
        """Parse the spec into a grammar (no tokenizer work): a bad schema, regex or grammar raises here.
        Specs seen recently are not parsed again (a batch of prompts shares one)."""
        key = so.cache_key()
        with self._lock:
            if key not in self._compiled and self._num_compiling() >= MAX_PENDING_COMPILES:
                raise InvalidParameterError(  # checked here, on the request's thread: never in the engine loop
                    f"{MAX_PENDING_COMPILES} distinct grammars are compiling already; retry later", "structured_outputs"
                )
            if key in self._validated:
                self._validated.move_to_end(key)
                return
        self._parse(so)
        with self._lock:
            self._validated[key] = None
            if len(self._validated) > 256:
                self._validated.popitem(last=False)

    # -- compiling, off the engine loop --------------------------------------------------------
    def submit(self, request: Request) -> None:
        so = request.sampling_params.structured_outputs
        assert isinstance(so, StructuredOutputsParams)  # the core submits only constrained requests (dicts parsed)
        key = so.cache_key()
        t0 = time.perf_counter()
        with self._lock:
            fut = self._compiled.get(key)
            hit = fut is not None and not _failed(fut)  # compiled, or compiling
            if fut is not None and hit:
                self._compiled.move_to_end(key)
            else:
                fut = self._pool.submit(self._compile, so)
                self._compiled[key] = fut
                if len(self._compiled) > 256:
                    self._compiled.popitem(last=False)
        if hit:
            self._record((time.perf_counter() - t0, True))
        self._pending[request.request_id] = (fut, time.monotonic())
        self.num_constrained_requests += 1
        self._events.append(None)

    def _record(self, event: tuple[float, bool]) -> None:
        self.compile_seconds.append(event)
        if len(self.compile_seconds) > 4096:  # a bounded history for make_stats
            del self.compile_seconds[:2048]
        self._events.append(event)

    def take_events(self) -> tuple[int, list[tuple[float, bool]]]:
        """Constrained requests and compiles (seconds, cache hit) since the last call (for /metrics)."""
        events = []
        while self._events:  # popleft is atomic; compile threads may append meanwhile
            events.append(self._events.popleft())
        return sum(e is None for e in events), [e for e in events if e is not None]

    def _compile(self, so: StructuredOutputsParams) -> tuple[Any, Any]:
        t0 = time.perf_counter()
        backend, grammar = self._parse(so)
        compiled = backend.compile(grammar)
        self._record((time.perf_counter() - t0, False))
        return backend, compiled

    def poll(self, request: Request) -> str:
        """``"ready"`` (a matcher made for it and its n>1 siblings), ``"waiting"``, or an error message (the
        compile failed or timed out)."""
        rid = request.request_id
        fut, since = self._pending[rid]
        if not fut.done():
            if time.monotonic() - since > self.compile_timeout:
                del self._pending[rid]
                return f"grammar compilation took longer than {self.compile_timeout:.0f}s"
            return "waiting"
        del self._pending[rid]
        if _failed(fut):
            return f"grammar compilation failed: {'cancelled' if fut.cancelled() else fut.exception()}"
        backend, compiled = fut.result()
        for r in [request, *request.pending_children]:
            self.matchers[r.request_id] = (backend, backend.matcher(compiled))
        return "ready"

    def wait_any(self, timeout: float) -> None:
        wait([f for f, _ in self._pending.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    def remove(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        entry = self._pending.pop(request_id, None)
        if entry is not None and not any(f is entry[0] for f, _ in self._pending.values()):
            entry[0].cancel()  # nobody else waits for it: drop it if it has not started (a running one runs on)

    def _num_compiling(self) -> int:
        return sum(not f.done() for f in self._compiled.values())

    # -- every step ------------------------------------------------------------------------
    def bitmasks(self, so: SchedulerOutput, requests: dict[str, Request]) -> dict[str, torch.Tensor]:
        """[1 + drafts, words] allowed-token bits for each constrained request that samples this step."""
        out = {}
        for rid in so.num_scheduled_tokens:
            entry = self.matchers.get(rid)
            if entry is None:
                continue
            req = requests[rid]
            drafts = so.scheduled_spec_tokens.get(rid, [])
            if req.num_computed_tokens < len(req.all_token_ids) + len(drafts):
                continue  # a prefill chunk that does not reach the end: nothing sampled
            out[rid] = self._fill(*entry, drafts)
        return out

    def _fill(self, backend: Any, matcher: Any, drafts: list[int]) -> torch.Tensor:
        """Row j: the tokens allowed after the drafts before it (the matcher is left where it was). Once the
        grammar is complete (its EOS taken: with ignore_eos, or an EOS draft), only EOS again."""
        mask = backend.allocate(len(drafts) + 1)
        if backend.terminated(matcher):
            return allow_only(mask, self.eos_token_ids)
        backend.fill_row(matcher, mask, 0)
        accepted = 0
        for j, tok in enumerate(drafts):
            if not backend.accept(matcher, tok):
                mask[j + 1 :] = 0  # unreachable: the drafts were validated; allow nothing rather than anything
                break
            accepted += 1
            if backend.terminated(matcher):
                allow_only(mask[j + 1 :], self.eos_token_ids)
                break
            backend.fill_row(matcher, mask, j + 1)
        if accepted:
            backend.rollback(matcher, accepted)
        return mask

    def update(self, runner_out: ModelRunnerOutput) -> None:
        """Advance the matchers with the kept tokens; cut new drafts where the grammar would refuse them."""
        for rid, tokens in runner_out.sampled.items():
            entry = self.matchers.get(rid)
            if entry is None:
                continue
            backend, m = entry
            for tok in tokens:
                if backend.terminated(m):
                    break
                if not backend.accept(m, tok):
                    logger.warning("request %s: token %d is outside its grammar", rid, tok)
                    break
        for rid, drafts in runner_out.spec_token_ids.items():
            entry = self.matchers.get(rid)
            if entry is not None and drafts:
                backend, m = entry
                runner_out.spec_token_ids[rid] = drafts[: backend.valid_prefix(m, drafts)]

    def make_stats(self) -> dict[str, Any]:
        return {
            "num_constrained_requests": self.num_constrained_requests,
            "compile_seconds": list(self.compile_seconds),
        }
