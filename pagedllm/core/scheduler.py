"""Iteration-level scheduler: decides, each step, how many tokens of which requests to compute.

One rule covers prefill, chunked prefill, prefix-cache hits and decode: a
request is given ``min(budget, num_tokens - num_computed_tokens)`` tokens.
Running requests go first (in admission order), then waiting ones (FCFS or
priority). When the KV cache runs out, the lowest-priority (then newest)
running request is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.encoder_cache import EncoderCacheManager, EncoderStats
from pagedllm.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

# the runner's results (torch-free); SampleLogprobs is imported for those who import it from here
from pagedllm.worker.runner_output import ModelRunnerOutput, SampleLogprobs  # noqa: F401

if TYPE_CHECKING:
    from pagedllm.core.kv_groups import KVGroups
    from pagedllm.kv_transfer import KVConnectorMetadata, KVConnectorStats
    from pagedllm.kv_transfer.mooncake import MooncakeScheduler
    from pagedllm.kv_transfer.offload import OffloadScheduler


@dataclass(slots=True)
class NewRequestData:
    """Everything the model runner needs to start (or restart after preemption) a request."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: Any = None  # LoRARequest | None
    group_block_ids: list[list[int]] = field(default_factory=list)  # the local groups' (kv_groups), if any
    pooling_params: Any = None  # PoolingParams of a pooling request (None: it samples)
    mm_features: list[Any] = field(default_factory=list)  # its images (MultiModalFeature), pixels included


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already knows: what changed since the last step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    new_group_block_ids: list[list[int]] = field(default_factory=list)  # the local groups' (kv_groups), if any


@dataclass(slots=True)
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished or preempted since the last step: the runner drops their state
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): copy before the forward
    # speculative decoding: the drafts each request verifies this step (after its last known token)
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # structured outputs: allowed-token bits ([1 + drafts, ceil(V / 32)] int32) of each constrained request
    # that samples this step; filled by the engine core's StructuredOutputManager
    grammar_bitmask: dict[str, Any] = field(default_factory=dict)
    # KV connector: the copies every rank makes before this step's forward (None: nothing to copy)
    kv_connector_meta: KVConnectorMetadata | None = None
    # vision-language models: the images each request's encoder computes this step (indices into its
    # mm_features), and the cached encoder outputs to drop first (image hashes)
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    freed_encoder_inputs: list[str] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int  # since the last stats call
    prefix_cache: PrefixCacheStats
    spec_decode: SpecDecodeStats | None = None  # since the last stats call; None without speculation
    kv_connector: KVConnectorStats | None = None  # since the last stats call; None without a connector
    encoder: EncoderStats | None = None  # since the last stats call; None without a vision encoder
    encoder_cache_usage: float = 0.0  # tokens cached / capacity


@dataclass(slots=True)
class SpecDecodeStats:
    num_drafts: int = 0  # requests that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: drafts accepted at each position

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos += [0] * (num_drafts - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


class Scheduler:
    def __init__(
        self,
        sched: SchedulerConfig,
        cache: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        num_lookahead_tokens: int = 0,
        speculative: bool = False,
        max_loras: int = 1,
        kv_connector: OffloadScheduler | MooncakeScheduler | None = None,
        kv_groups: KVGroups | None = None,
        pooling_needs_kv: bool = True,
        encoder: tuple[int, int] | None = None,
        whole_images: bool = False,
    ):
        self.config = sched
        # Gemma 3: an image's tokens attend to each other both ways, so a chunk never ends inside an image
        self.whole_images = whole_images
        # vision-language models (``encoder``: the encoder's tokens per step, the encoder cache's size in tokens):
        # the budget, and the record of the runner's encoder cache
        self.encoder_budget = encoder[0] if encoder is not None else 0
        self.encoder_cache = EncoderCacheManager(encoder[1]) if encoder is not None else None
        # a pooling request of a decoder writes its K/V somewhere during its one pass; an encoder's needs no block
        self.pooling_needs_kv = pooling_needs_kv
        self.connector = kv_connector
        self.max_loras = max_loras  # distinct adapters among the running requests, at most
        # slots past the verified tokens a proposer writes its own KV into (the draft model's)
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec_stats = SpecDecodeStats() if speculative else None
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, kv_groups)
        if kv_connector is not None:
            self.kv.pool.on_evict = kv_connector.on_primary_evict
            kv_connector.bind(self.kv)
        self.requests: dict[str, Request] = {}
        self.waiting = _WaitQueue(sched.scheduling_policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self._num_preemptions_reported = 0
        self._unsent: set[str] = set()  # running requests the runner has not been told about (forked children)
        self._num_unforked = 0  # n>1 siblings registered but not yet forked off their leader's prompt
        self._pending_copies: list[tuple[int, int]] = []
        self._in_flight: dict[str, int] = {}  # request id -> its scheduled steps whose output is not in yet
        # requests of a step that raised, each with the computed-token count it failed at: recomputed one at a
        # time (never two in one step) until each gets past that point or fails again alone (see isolate_failure)
        self.suspects: dict[str, int] = {}

    # -- request table --------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; its pending n>1 siblings are registered but wait for the fork."""
        self.requests[request.request_id] = request
        for child in request.pending_children:
            self.requests[child.request_id] = child
        self._num_unforked += len(request.pending_children)
        self.waiting.push(request)

    def abort_requests(self, req_ids: list[str]) -> list[Request]:
        aborted = []
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is not None and not req.status.finished:
                self._finish(req, RequestStatus.FINISHED_ABORTED)
                aborted.append(req)
        return aborted

    def has_unfinished_requests(self) -> bool:
        """Also true while a KV connector has copies to send (a finished request's blocks to save): one more
        step, empty but for them, carries them to the workers."""
        return (
            bool(self.running) or len(self.waiting) > 0 or (self.connector is not None and self.connector.has_pending())
        )

    def num_waiting_requests(self) -> int:
        """Requests not running yet, unforked n>1 siblings included; O(1)."""
        return len(self.waiting) + self._num_unforked

    # -- one step ---------------------------------------------------------------
    def schedule(self, max_seqs: int | None = None) -> SchedulerOutput:
        """``max_seqs`` caps this step's requests below ``max_num_seqs`` (pipeline parallelism splits the
        running requests into one micro-batch per stage)."""
        budget = self.config.max_num_batched_tokens
        cap = max_seqs or self.config.max_num_seqs
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted_now = False
        now = time.monotonic()
        if self.connector is not None:
            self.connector.start_step()

        if self.config.scheduling_policy == "priority":
            # serve the most important first, so victims (taken from the unserved tail) are the least
            self.running.sort(key=lambda r: (r.priority, r.arrival_time))
        scheduled_spec: dict[str, list[int]] = {}
        encoder_budget = self.encoder_budget
        scheduled_encoder: dict[str, list[int]] = {}
        i = 0
        while i < len(self.running) and budget > 0 and len(num_scheduled) < cap:
            req = self.running[i]
            if req.num_computed_tokens == req.num_tokens:  # its last step is still in flight (pipeline)
                i += 1
                continue
            # drafts ride after the known tokens, under the same rule and budget; the tail that does not fit
            # (budget, max_tokens, context) is dropped. Nothing is kept for the next step: it proposes anew.
            spec, req.spec_token_ids = req.spec_token_ids, []
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            images: tuple[list[int], list[int]] = ([], [])
            if req.mm_features:
                n, images = self._fit_images(req, req.num_computed_tokens, n, encoder_budget)
                if n == 0:  # an image it reaches cannot be encoded this step
                    req.spec_token_ids = spec
                    i += 1
                    continue
            if spec and n == req.num_tokens - req.num_computed_tokens:
                room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
                spec = spec[: max(0, min(room, budget - n))]
                n += len(spec)
            else:
                spec = []
            new_blocks = self._allocate(req, n)
            victim = None
            while new_blocks is None:
                victim = self._pick_victim(i)
                if victim is None:
                    break
                self._preempt(victim)
                preempted_now = True
                if victim is req:
                    break
                new_blocks = self._allocate(req, n)
            if new_blocks is None:
                if victim is None:  # the others all wait on a step in flight: try this one again next step
                    i += 1
                continue  # (else req itself was preempted and removed from running)
            num_scheduled[req.request_id] = n
            if images[0] or images[1]:
                encoder_budget -= self._take_images(req, images, scheduled_encoder)
            if spec:
                scheduled_spec[req.request_id] = spec
            if req.request_id in self._unsent:  # a forked child: the runner sees it for the first time
                self._unsent.discard(req.request_id)
                new_reqs.append(self._new_request_data(req))
            else:
                cached_reqs.append(
                    CachedRequestData(
                        req.request_id,
                        [b.block_id for b in new_blocks[0]],
                        req.num_computed_tokens,
                        [[b.block_id for b in g] for g in new_blocks[1:]],
                    )
                )
            budget -= n
            i += 1

        # admit waiting requests, unless we just had to preempt (no room anyway)
        adapters = {r.lora_int_id for r in self.running} - {0}
        skipped: list[Request] = []  # waiting for an adapter slot, or a suspect's turn: others are admitted meanwhile
        suspect_running = bool(self.suspects) and any(r.request_id in self.suspects for r in self.running)
        while (
            not preempted_now
            and len(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and len(num_scheduled) < cap
        ):
            req = self.waiting.peek()
            if req.lora_int_id and req.lora_int_id not in adapters and len(adapters) >= self.max_loras:
                skipped.append(self.waiting.pop())
                continue
            if req.request_id in self.suspects:
                if suspect_running:
                    skipped.append(self.waiting.pop())
                    continue
                suspect_running = True
            hits, num_hit_tokens, ext = None, 0, 0
            pooling = req.pooling_params is not None
            if req.num_computed_tokens == 0 and not pooling:  # pooling: no prefix caching, nothing kept
                hits, num_hit_tokens = self.kv.get_computed_blocks(req)
                if self.connector is not None:  # the next tier: tokens it can load instead of computing
                    ext = self.connector.get_num_new_matched_tokens(req, num_hit_tokens)
            n = req.num_tokens - num_hit_tokens - ext
            whole = pooling or not self.config.enable_chunked_prefill
            if whole and n > budget:
                break  # head-of-line waits for a step with enough budget (a pooling prompt is never chunked)
            n = min(n, budget)
            images = ([], [])
            if req.mm_features:
                start = req.num_computed_tokens + num_hit_tokens + ext
                cut, images = self._fit_images(req, start, n, encoder_budget)
                if cut == 0 or (whole and cut < n):
                    break  # head-of-line waits for the encoder budget or cache room its images need
                n = cut
            if pooling and not self.pooling_needs_kv:
                new_blocks = [[]]
            else:
                new_blocks = self._allocate(req, ext + n, hits, num_hit_tokens)
            if new_blocks is None:
                break
            if self.connector is not None:
                self.connector.update_state_after_alloc(req, self.kv.get_block_ids(req.request_id), num_hit_tokens, ext)
            self.waiting.pop()
            if req.num_computed_tokens == 0 and not pooling:
                self.kv.record_lookup(req, num_hit_tokens)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit_tokens + ext
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens + ext
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            num_scheduled[req.request_id] = n
            if images[0] or images[1]:
                encoder_budget -= self._take_images(req, images, scheduled_encoder)
            new_reqs.append(self._new_request_data(req))
            budget -= n
            if req.lora_int_id:
                adapters.add(req.lora_int_id)
        for req in reversed(skipped):
            self.waiting.push_front(req)

        out = SchedulerOutput(
            new_reqs,
            cached_reqs,
            num_scheduled,
            sum(num_scheduled.values()),
            self.finished_req_ids,
            self._pending_copies,
            scheduled_spec,
        )
        if self.encoder_cache is not None:
            out.scheduled_encoder_inputs = scheduled_encoder
            out.freed_encoder_inputs = self.encoder_cache.take_freed()
        self.finished_req_ids = set()
        self._pending_copies = []
        for rid, n in num_scheduled.items():
            req = self.requests[rid]
            if self.connector is not None:
                self.connector.on_scheduled(req, self.kv.req_blocks[rid], req.num_computed_tokens, n)
            req.num_computed_tokens += n
            self._in_flight[rid] = self._in_flight.get(rid, 0) + 1
            if req.mm_features:  # after this step is built: evicting what it reads starts with the next
                self._release_images(req, req.num_computed_tokens)
        if self.connector is not None:
            out.kv_connector_meta = self.connector.build_connector_meta()
        return out

    # -- images (vision-language models) ---------------------------------------------
    def _fit_images(self, req: Request, start: int, n: int, encoder_budget: int) -> tuple[int, tuple[list, list]]:
        """:meth:`_fit_encoder`, and under ``whole_images`` the chunk cut before an image it would end inside (to
        nothing where it starts inside one it cannot finish: it waits for a step with room)."""
        n, (encode, read) = self._fit_encoder(req, start, n, encoder_budget)
        if self.whole_images:
            end = start + n
            for f in req.mm_features:
                if f.offset < end < f.end:
                    n = max(0, f.offset - start)
                    encode = [k for k in encode if req.mm_features[k].offset < start + n]
                    read = [k for k in read if req.mm_features[k].offset < start + n]
                    break
        return n, (encode, read)

    def _fit_encoder(self, req: Request, start: int, n: int, encoder_budget: int) -> tuple[int, tuple[list, list]]:
        """Tokens ``[start, start + n)`` of ``req`` as far as this step can give their images: an image its chunk
        reaches is read from the encoder cache, or encoded where the step's encoder budget and the cache's room
        allow; the chunk stops before the first that is neither. Returns the tokens and (images to encode,
        images to read), as indices into ``req.mm_features``."""
        cache = self.encoder_cache
        assert cache is not None, "a request with images reached an engine without a vision encoder"
        encode: list[int] = []
        read: list[int] = []
        pending = 0  # tokens of the images this request encodes in this step
        pinned: set[str] = set()  # cached images nobody reads yet that this chunk reads: no longer evictable room
        for k, f in enumerate(req.mm_features):
            if f.offset >= start + n:
                break
            if f.end <= start:
                continue  # computed already: its KV is in the cache
            h = f.identifier
            if any(req.mm_features[j].identifier == h for j in encode):
                continue  # the same image twice in one chunk: encoded once
            if cache.has(h):
                if cache.is_unread(h) and h not in pinned:
                    if not cache.fits(pending + cache.pinned_size(pinned | {h})):
                        return max(0, f.offset - start), (encode, read)  # reading it would leave no room
                    pinned.add(h)
                read.append(k)
            elif f.length <= encoder_budget - pending and cache.fits(pending + f.length + cache.pinned_size(pinned)):
                encode.append(k)
                pending += f.length
            else:
                return max(0, f.offset - start), (encode, read)
        return n, (encode, read)

    def _take_images(self, req: Request, images: tuple[list[int], list[int]], scheduled: dict[str, list[int]]) -> int:
        """Commit what :meth:`_fit_images` found for a request now scheduled; returns the encoder tokens spent."""
        cache = self.encoder_cache
        assert cache is not None
        encode, read = images
        for k in read:
            cache.read(req.mm_features[k].identifier, req.request_id)
        spent = 0
        for k in encode:
            f = req.mm_features[k]
            cache.add(f.identifier, f.length, req.request_id)
            spent += f.length
        if encode:
            scheduled[req.request_id] = encode
        return spent

    def _release_images(self, req: Request, computed: int) -> None:
        """``req`` stops reading the images whose placeholders end at or before ``computed`` (one it reads again
        later in its prompt is read, or encoded, again then: holding it meanwhile could leave no room for the
        images between)."""
        cache = self.encoder_cache
        if cache is None:
            return
        reading = {f.identifier for f in req.mm_features if f.offset < computed < f.end}  # partly computed
        for f in req.mm_features:
            if f.end <= computed and f.identifier not in reading:
                cache.release(f.identifier, req.request_id)

    def _allocate(self, req: Request, n: int, hits=None, num_hit_tokens: int = 0):
        lookahead = 0
        if self.num_lookahead_tokens:  # never past the context: positions there do not exist
            end = req.num_computed_tokens + num_hit_tokens + n
            lookahead = max(0, min(self.num_lookahead_tokens, self.max_model_len - end))
        return self.kv.allocate_slots(req, n, hits, num_hit_tokens, lookahead)

    def _new_request_data(self, req: Request) -> NewRequestData:
        return NewRequestData(
            req.request_id,
            req.prompt_token_ids,
            list(req.output_token_ids),
            req.sampling_params,
            self.kv.get_block_ids(req.request_id),
            req.num_computed_tokens,
            req.lora_request,
            self.kv.get_group_block_ids(req.request_id),
            req.pooling_params,
            req.mm_features,
        )

    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[tuple[Request, int]]:
        """Append sampled tokens, apply stop conditions; return the requests that got new tokens, each with
        how many it kept (tokens after a stop are dropped)."""
        now = time.monotonic()
        self._step_done(sched_out)
        for rid in [r for r in sched_out.num_scheduled_tokens if r in self.suspects]:
            if self.requests[rid].num_computed_tokens >= self.suspects[rid]:  # past where it failed: cleared
                del self.suspects[rid]
        touched: list[tuple[Request, int]] = []
        for rid, why in runner_out.failed.items():
            req = self.requests.get(rid)
            if req is not None and not req.status.finished:
                touched += [(r, 0) for r in self.fail(req, why)]
        for rid, tokens in runner_out.sampled.items():
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            spec = sched_out.scheduled_spec_tokens.get(rid)
            if spec:  # one rule for the rollback: the rejected drafts were never computed
                accepted = len(tokens) - 1
                req.num_computed_tokens -= len(spec) - accepted
                req.num_draft_tokens += len(spec)
                req.num_accepted_tokens += accepted
                assert self.spec_stats is not None  # drafts are scheduled only with speculative decoding on
                self.spec_stats.observe(len(spec), accepted)
            if req.first_token_time is None:
                req.first_token_time = now
            before = req.num_output_tokens
            for token in tokens:
                req.append_output_token(token)
                if req.pending_children:  # the prompt is computed: its siblings can share it now
                    self._fork(req, now)
                self._check_stop(req)
                if req.status.finished:
                    break  # what follows a stop is dropped
            if not req.status.finished:
                req.spec_token_ids = runner_out.spec_token_ids.get(rid, [])
            touched.append((req, req.num_output_tokens - before))
        for rid in runner_out.pooler_output:  # a pooling request is done after its one step: free its blocks now
            req = self.requests.get(rid)
            if req is not None and not req.status.finished:
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                touched.append((req, 0))
        return touched

    def _step_done(self, sched_out: SchedulerOutput) -> None:
        for rid in sched_out.num_scheduled_tokens:
            left = self._in_flight.pop(rid) - 1
            if left:
                self._in_flight[rid] = left

    def isolate_failure(self, sched_out: SchedulerOutput, why: str) -> list[Request]:
        """A step raised before it produced anything: find the request that caused it.

        A step of one request, or of one suspect, has its culprit: that request finishes with an error
        (returned, with any n>1 siblings). Otherwise every request of the step becomes a suspect. Each request
        of the step is recomputed (preempted): the step's KV writes may be partial, so its blocks also leave
        the prefix cache. Suspects then run at most one per step, so a fault that recurs names its request; a
        suspect is cleared once it computes past the point it failed at."""
        ids = list(sched_out.num_scheduled_tokens)
        here = [rid for rid in ids if rid in self.suspects]
        self._step_done(sched_out)
        self.finished_req_ids |= sched_out.finished_req_ids  # the runner may not have dropped them: again
        culprit = ids[0] if len(ids) == 1 else here[0] if len(here) == 1 else None
        failed: list[Request] = []
        for rid in ids:
            req = self.requests[rid]
            for b in self.kv.req_blocks.get(rid, []):
                self.kv.pool.uncache(b)
            if rid == culprit:
                self.suspects.pop(rid, None)
                failed = self.fail(req, why)
                continue
            if culprit is None:
                self.suspects[rid] = req.num_computed_tokens  # (scheduled: it counts this step's tokens)
            self._preempt(req)
        return failed

    def handle_kv_load_failures(self, runner_out: ModelRunnerOutput) -> None:
        """Blocks the worker could not load held garbage in this step's forward: every request reading one
        loses this step's output and is preempted (recomputed), and the blocks computed from it leave the
        prefix cache. Call before anything reads ``runner_out``."""
        failed = set(runner_out.kv_load_failed)
        for req in list(self.running):
            blocks = self.kv.req_blocks.get(req.request_id, [])
            bad = next((i for i, b in enumerate(blocks) if b.block_id in failed), None)
            if bad is None:
                continue
            assert self.connector is not None  # only a connector loads blocks
            self.connector.on_load_failed([b.block_hash for b in blocks[bad:] if b.block_id in failed])
            for b in blocks[bad:]:
                self.kv.pool.uncache(b)
            for out in (
                runner_out.sampled,
                runner_out.logprobs,
                runner_out.spec_token_ids,
                runner_out.prompt_logprobs,
                runner_out.pooler_output,
            ):
                out.pop(req.request_id, None)
            self._preempt(req)

    def _fork(self, leader: Request, now: float) -> None:
        """Start n>1 siblings off the leader's prompt KV: shared full blocks, a copy of the last one.

        Each sibling recomputes only the last prompt token (to get its own logits and
        sample with its own seed). Without a free block or a free sequence slot it
        simply queues, and recomputes its prompt (prefix-cache hits still apply).
        """
        children, leader.pending_children = leader.pending_children, []
        self._num_unforked -= len(children)
        for child in children:
            if child.status.finished:
                continue
            copies = None
            if len(self.running) < self.config.max_num_seqs:
                copies = self.kv.fork(leader, child)
            if copies is None:
                self.waiting.push(child)
                continue
            self._pending_copies.extend(copies)
            child.num_computed_tokens = child.num_prompt_tokens - 1
            child.num_cached_tokens = max(leader.num_cached_tokens, 0)
            child.status = RequestStatus.RUNNING
            child.first_scheduled_time = now
            self.running.append(child)
            self._unsent.add(child.request_id)

    def _check_stop(self, req: Request) -> None:
        last = req.output_token_ids[-1]
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens and last in sp._finish_token_ids:
            assert sp.stop_token_ids is not None  # normalised to a list by SamplingParams
            req.stop_reason = None if last not in sp.stop_token_ids else last
            self._finish(req, RequestStatus.FINISHED_STOPPED)
        elif req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            self._finish(req, RequestStatus.FINISHED_LENGTH)

    def finish_request(self, req_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Finish from outside the step (e.g. a stop string found by the detokenizer)."""
        req = self.requests.get(req_id)
        if req is not None and not req.status.finished:
            req.stop_reason = stop_reason
            self._finish(req, status)

    def fail(self, req: Request, why: str) -> list[Request]:
        """Finish a request with an error (``why`` becomes its stop_reason), and its n>1 siblings still waiting
        for its prompt with it; its blocks are freed at once. Returns the requests it finished."""
        siblings = req.pending_children
        req.stop_reason = why
        self._finish(req, RequestStatus.FINISHED_ERROR)
        for child in siblings:  # never forked: they hold no blocks and sit in no queue
            child.status, child.stop_reason = RequestStatus.FINISHED_ERROR, why
        return [req, *siblings]

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self._unsent.discard(req.request_id)
        self.suspects.pop(req.request_id, None)
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)  # O(1): dropped lazily when it reaches the head
        if req.pending_children:  # a leader gone before its prompt was computed: its siblings never fork
            self._num_unforked -= len(req.pending_children)
            req.pending_children = []
        req.status = status
        if self.connector is not None:
            self.connector.request_finished(req)
        self._release_images(req, 1 << 62)
        self.kv.free(req)
        self.finished_req_ids.add(req.request_id)

    def release(self, req_id: str) -> None:
        """Forget a finished request once its output has been delivered."""
        req = self.requests.get(req_id)
        if req is not None and req.status.finished:
            del self.requests[req_id]

    # -- preemption -----------------------------------------------------------
    def _pick_victim(self, first_unscheduled: int) -> Request | None:
        """The newest (FCFS) or least important (priority) request not yet served this step. A request
        with a step still in flight (pipeline parallelism) is never a victim: that step's token or prompt
        logprobs would land on the recomputed request."""
        candidates = [r for r in self.running[first_unscheduled:] if r.request_id not in self._in_flight]
        if not candidates:
            return None
        if self.config.scheduling_policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._unsent.discard(req.request_id)
        if self.connector is not None:
            self.connector.on_preempt(req, self.kv.get_block_ids(req.request_id))
        self.kv.free(req)
        self._release_images(req, 1 << 62)  # its images stay cached (unread) for its recompute, room allowing
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.finished_req_ids.add(req.request_id)  # the runner drops its state; it comes back as new
        self.waiting.push_front(req)

    # -- observability ----------------------------------------------------------
    def make_stats(self) -> SchedulerStats:
        new_preemptions = self.num_preemptions - self._num_preemptions_reported
        self._num_preemptions_reported = self.num_preemptions
        spec = self.spec_stats
        if spec is not None:
            self.spec_stats = SpecDecodeStats()
        return SchedulerStats(
            len(self.running),
            self.num_waiting_requests(),
            self.kv.usage(),
            new_preemptions,
            self.kv.stats.reset(),
            spec,
            self.connector.take_stats() if self.connector is not None else None,
            self.encoder_cache.stats.take() if self.encoder_cache is not None else None,
            self.encoder_cache.used / self.encoder_cache.capacity if self.encoder_cache is not None else 0.0,
        )

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        if self.connector is not None:
            self.connector.check_invariants()
        for req in self.running:
            assert req.status == RequestStatus.RUNNING
            assert req.num_computed_tokens <= req.num_tokens
        for rid in self.kv.req_blocks:
            assert self.requests[rid].status == RequestStatus.RUNNING, f"{rid} holds blocks but is not running"
        for rid in self.suspects:
            assert not self.requests[rid].status.finished, f"suspect {rid} has finished"
        assert sum(r.request_id in self.suspects for r in self.running) <= 1, "two suspects run at once"
        if self.encoder_cache is not None:
            self.encoder_cache.check_invariants({r.request_id for r in self.running})


class _WaitQueue:
    """The waiting requests: FCFS lanes served in turn, or a heap by (priority, arrival).

    FCFS keeps one FIFO lane per request group (the prompts and completions of one
    user request) and takes the groups in turn: a group whose request was just
    admitted goes to the back, so a batch of hundreds of prompts cannot hold back
    a small request that arrived after it. Single-prompt requests are groups of
    one, so for them this is plain arrival order. A preempted request goes to the
    very front. ::

        lanes:  [g7: r70 r71 r72] -> [g9: r90] -> [g3: r31 r32]      pop() = r70, g7 to the back

    Removal is lazy: a removed request leaves the member set at once and its entry
    is dropped when it reaches a lane's head (or in a compaction once stale entries
    outnumber live ones), so aborting any number of waiting requests costs
    amortised O(1) each and a step never scans the queue.
    """

    def __init__(self, policy: str):
        self.fcfs = policy == "fcfs"
        self._lanes: OrderedDict[str, deque[Request]] = OrderedDict()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._members: set[int] = set()  # id() of the requests really queued
        self._stale = 0  # removed entries still in a lane / the heap
        self._counter = 0

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, req: Request) -> bool:
        return id(req) in self._members

    def push(self, req: Request) -> None:
        self._members.add(id(req))
        if self.fcfs:
            lane = self._lanes.get(req.queue_group)
            if lane is None:
                self._lanes[req.queue_group] = deque([req])
            else:
                lane.append(req)
        else:
            self._counter += 1
            heapq.heappush(self._heap, (req.priority, req.arrival_time, self._counter, req))

    def push_front(self, req: Request) -> None:
        # (priority, arrival) already puts a preempted request where it belongs in the heap
        if self.fcfs:
            self._members.add(id(req))
            self._lanes.setdefault(req.queue_group, deque()).appendleft(req)
            self._lanes.move_to_end(req.queue_group, last=False)
        else:
            self.push(req)

    def peek(self) -> Request:
        self._drop_removed()
        return next(iter(self._lanes.values()))[0] if self.fcfs else self._heap[0][3]

    def pop(self) -> Request:
        self._drop_removed()
        if self.fcfs:
            group, lane = next(iter(self._lanes.items()))
            req = lane.popleft()
            if lane:
                self._lanes.move_to_end(group)  # this group had its turn
            else:
                del self._lanes[group]
        else:
            req = heapq.heappop(self._heap)[3]
        self._members.discard(id(req))
        return req

    def remove(self, req: Request) -> None:
        if id(req) in self._members:
            self._members.discard(id(req))
            self._stale += 1
            if self._stale > len(self._members) + 64:  # amortised O(1): removed requests hold no memory long
                self._compact()

    def _compact(self) -> None:
        if self.fcfs:
            lanes = ((g, deque(r for r in lane if id(r) in self._members)) for g, lane in self._lanes.items())
            self._lanes = OrderedDict((g, lane) for g, lane in lanes if lane)
        else:
            self._heap = [e for e in self._heap if id(e[3]) in self._members]
            heapq.heapify(self._heap)
        self._stale = 0

    def _drop_removed(self) -> None:
        if self.fcfs:
            while self._lanes:
                group, lane = next(iter(self._lanes.items()))
                while lane and id(lane[0]) not in self._members:
                    lane.popleft()
                    self._stale -= 1
                if lane:
                    return
                del self._lanes[group]
        else:
            while self._heap and id(self._heap[0][3]) not in self._members:
                heapq.heappop(self._heap)
                self._stale -= 1
