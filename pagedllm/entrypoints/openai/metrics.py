"""Prometheus metrics with vLLM's names under the `pagedllm:` prefix, on a per-server registry."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r, m = self.registry, model_name

        def gauge(name, doc):
            return Gauge(f"pagedllm:{name}", doc, labels, registry=r).labels(m)

        def counter(name, doc, extra=()):
            c = Counter(f"pagedllm:{name}", doc, labels + list(extra), registry=r)
            return c if extra else c.labels(m)

        def hist(name, doc, buckets):
            return Histogram(f"pagedllm:{name}", doc, labels, buckets=buckets, registry=r).labels(m)

        self.model_name = m
        self.running = gauge("num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache usage (1 = full).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.external_queries = counter(
            "external_prefix_cache_queries", "KV tiers (RAM, disk): tokens looked up past the prefix cache's hit."
        )
        self.external_hits = counter(
            "external_prefix_cache_hits", "KV tiers (RAM, disk): tokens found there and loaded instead of computed."
        )
        self.kv_tier_bytes = counter(
            "kv_offload_bytes", "KV tiers: bytes copied, by tier and direction.", extra=["tier", "direction"]
        )
        self.kv_transfer_seconds = counter(
            "kv_transfer_seconds",
            "KV tiers: worker time spent copying blocks (the driver rank's), by direction.",
            extra=["direction"],
        )
        for tier in ("ram", "disk"):
            for direction in ("save", "load"):
                self.kv_tier_bytes.labels(m, tier, direction)
        for direction in ("save", "load"):
            self.kv_transfer_seconds.labels(m, direction)
        self.kv_remote_bytes = counter(
            "kv_transfer_bytes",
            "MooncakeConnector: KV bytes a consumer read from producers (pull), and a producer's held bytes "
            "that consumers read and released (serve).",
            extra=["direction"],
        )
        for direction in ("pull", "serve"):
            self.kv_remote_bytes.labels(m, direction)
        self.kv_remote_pulls = counter("kv_transfer_pulls", "MooncakeConnector: requests whose prompt KV was read.")
        self.kv_remote_failures = counter(
            "kv_transfer_failures",
            "MooncakeConnector: reads that failed (producer gone, blocks no longer held); the prompt was recomputed.",
        )
        self.kv_remote_timeouts = counter(
            "kv_transfer_hold_timeouts", "MooncakeConnector: prefills whose blocks no consumer pulled in time (freed)."
        )
        self.kv_remote_pending = gauge(
            "kv_transfer_pending", "MooncakeConnector: prefills whose blocks a producer holds for a consumer."
        )
        self.kv_swaps = counter(
            "kv_preemption_swaps",
            "Preempted requests whose partial last block was swapped to the RAM tier (preemption_mode='swap').",
        )
        self.engine_restarts = counter(
            "engine_restarts", "Rebuilds of the engine core after a step failed that no request could be blamed for."
        )
        self.stored_responses_bytes = gauge(
            "responses_store_bytes", "Bytes the Responses API's stored responses hold (--max-stored-response-bytes)."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Generation tokens produced.")
        self.success = counter("request_success", "Finished requests.", extra=["finished_reason"])
        for reason in ("stop", "length", "abort", "error"):  # export every series from the start, at 0
            self.success.labels(m, reason)
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.", _LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS)
        self.queue_time = hist(
            "request_queue_time_seconds", "Time spent waiting before first scheduled.", _LATENCY_BUCKETS
        )
        self.req_prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.req_gen_tokens = hist("request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS)
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative decoding: verifications (requests x steps).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.")
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted at each draft position.",
            extra=["position"],
        )
        self.constrained = counter("structured_output_requests", "Requests with structured outputs (a grammar).")
        self.grammar_compile = hist(
            "grammar_compile_seconds",
            "Structured outputs: time to compile a grammar (cold compiles; cache hits are counted apart).",
            _LATENCY_BUCKETS,
        )
        self.grammar_cache_hits = counter(
            "grammar_compile_cache_hits", "Structured outputs: grammars served from the compile cache."
        )
        self.engine_state_snapshots = counter(
            "engine_state_snapshots", "Engine snapshots taken for /v1/engine/state and its stream (the dashboard)."
        )
        # vision-language models: vLLM's multimodal cache names, counting the encoder cache's lookups
        self.mm_cache_queries = counter("mm_cache_queries", "Images a request reached, looked up in the encoder cache.")
        self.mm_cache_hits = counter("mm_cache_hits", "Images found in the encoder cache (not encoded again).")
        self.encoder_images = counter("encoder_images", "Images the vision encoder computed.")
        self.encoder_tokens = counter(
            "encoder_tokens", "Image tokens (encoder output rows) the vision encoder computed."
        )
        self.encoder_cache_usage = gauge("encoder_cache_usage_perc", "Encoder cache usage (1 = full).")
        self.lora_requests = counter("lora_requests", "Prompts sent to each LoRA adapter.", extra=["lora_name"])
        self.lora_info = Gauge(
            "pagedllm:lora_requests_info",
            "Running and waiting LoRA adapters (the value is the time of the last change), as vLLM reports them.",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=r,
        )
        self._lora_labels: tuple[str, str, str] | None = None
        self._last_token: dict[str, tuple[float, int]] = {}
        # for the dashboard: the latest latencies (wall time, seconds) and running totals, engine thread only
        self._recent_ttft: deque[tuple[float, float]] = deque(maxlen=512)
        self._recent_itl: deque[tuple[float, float]] = deque(maxlen=512)
        self._totals = {
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "spec_decode_draft_tokens": 0,
            "spec_decode_accepted_tokens": 0,
            "finished_requests": 0,
            "encoder_images": 0,
            "encoder_tokens": 0,
            "mm_cache_queries": 0,
            "mm_cache_hits": 0,
        }

    def on_step(self, engine: Any, outputs: list) -> None:
        """Called in the engine thread after every step."""
        if engine.lora_cache is not None:
            self._lora_step(engine)
        stats = engine.core.make_stats()
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.preemptions.inc(stats.num_preemptions)
        self.prefix_queries.inc(stats.prefix_cache.queries)
        self.prefix_hits.inc(stats.prefix_cache.hits)
        totals = self._totals
        totals["prefix_cache_queries"] += stats.prefix_cache.queries
        totals["prefix_cache_hits"] += stats.prefix_cache.hits
        kv = stats.kv_connector
        if kv is not None:
            self.external_queries.inc(kv.queries)
            self.external_hits.inc(kv.hits)
            for tier in ("ram", "disk"):
                for direction, field in (("save", "saved"), ("load", "loaded")):
                    self.kv_tier_bytes.labels(self.model_name, tier, direction).inc(
                        getattr(kv, f"{tier}_bytes_{field}")
                    )
            self.kv_transfer_seconds.labels(self.model_name, "save").inc(kv.save_seconds)
            self.kv_transfer_seconds.labels(self.model_name, "load").inc(kv.load_seconds)
            self.kv_swaps.inc(kv.swapped_out)
            self.kv_remote_bytes.labels(self.model_name, "pull").inc(kv.remote_bytes_pulled)
            self.kv_remote_bytes.labels(self.model_name, "serve").inc(kv.remote_bytes_served)
            self.kv_remote_pulls.inc(kv.remote_pulls)
            self.kv_remote_failures.inc(kv.remote_pull_failures)
            self.kv_remote_timeouts.inc(kv.remote_hold_timeouts)
            self.kv_remote_pending.set(kv.remote_pending)
        enc = stats.encoder
        if enc is not None:
            self.mm_cache_queries.inc(enc.queries)
            self.mm_cache_hits.inc(enc.hits)
            self.encoder_images.inc(enc.images)
            self.encoder_tokens.inc(enc.tokens)
            self.encoder_cache_usage.set(stats.encoder_cache_usage)
            totals["encoder_images"] += enc.images
            totals["encoder_tokens"] += enc.tokens
            totals["mm_cache_queries"] += enc.queries
            totals["mm_cache_hits"] += enc.hits
        spec = stats.spec_decode
        if spec is not None:
            totals["spec_decode_draft_tokens"] += spec.num_draft_tokens
            totals["spec_decode_accepted_tokens"] += spec.num_accepted_tokens
            self.spec_drafts.inc(spec.num_drafts)
            self.spec_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_accepted.inc(spec.num_accepted_tokens)
            for pos, n in enumerate(spec.accepted_per_pos):
                self.spec_accepted_per_pos.labels(self.model_name, str(pos)).inc(n)
        structured = getattr(engine, "structured", None)
        if structured is not None and structured._events:
            n_requests, compiles = structured.take_events()
            self.constrained.inc(n_requests)
            for seconds, hit in compiles:
                if hit:
                    self.grammar_cache_hits.inc()
                else:
                    self.grammar_compile.observe(seconds)
        now = time.monotonic()
        wall = time.time()
        for out in outputs:
            if not isinstance(out.outputs, list):  # a pooling request's: one output, when it finishes
                self._pooling_finished(out, now)
                continue
            n_tokens = sum(len(c.token_ids) for c in out.outputs)
            last = self._last_token.get(out.request_id)
            if last is None:
                if n_tokens:
                    ttft = now - out.metrics.arrival_time
                    self.ttft.observe(ttft)
                    self._recent_ttft.append((wall, ttft))
                    self.prompt_tokens.inc(len(out.prompt_token_ids) - out.num_cached_tokens)
                    totals["prompt_tokens"] += len(out.prompt_token_ids) - out.num_cached_tokens
            elif n_tokens > last[1]:
                itl = (now - last[0]) / (n_tokens - last[1])
                self.itl.observe(itl)
                self._recent_itl.append((wall, itl))
            self.generation_tokens.inc(n_tokens - (last[1] if last else 0))
            totals["generation_tokens"] += n_tokens - (last[1] if last else 0)
            self._last_token[out.request_id] = (now, n_tokens)
            if out.finished:
                totals["finished_requests"] += 1
                self._last_token.pop(out.request_id, None)
                reason = out.outputs[0].finish_reason or "abort"
                self.success.labels(self.model_name, reason).inc()
                self.e2e.observe(now - out.metrics.arrival_time)
                if out.metrics.first_scheduled_time is not None:
                    self.queue_time.observe(out.metrics.first_scheduled_time - out.metrics.arrival_time)
                self.req_prompt_tokens.observe(len(out.prompt_token_ids))
                self.req_gen_tokens.observe(n_tokens)

    def _pooling_finished(self, out: Any, now: float) -> None:
        """A pooling request (an embedding): its whole prompt computed in one step, nothing generated."""
        n = len(out.prompt_token_ids)
        if out.outputs is not None:
            self.prompt_tokens.inc(n)
            self._totals["prompt_tokens"] += n
        self._totals["finished_requests"] += 1
        self.success.labels(self.model_name, "stop" if out.outputs is not None else "abort").inc()
        self.e2e.observe(now - out.metrics.arrival_time)
        if out.metrics.first_scheduled_time is not None:
            self.queue_time.observe(out.metrics.first_scheduled_time - out.metrics.arrival_time)
        self.req_prompt_tokens.observe(n)

    def recent(self) -> dict:
        """The dashboard's latency samples and running totals (call on the engine thread, as on_step)."""
        return {
            "totals": dict(self._totals),
            "ttft": [[round(t, 3), round(v, 5)] for t, v in self._recent_ttft],
            "itl": [[round(t, 3), round(v, 5)] for t, v in self._recent_itl],
        }

    def _lora_step(self, engine: Any) -> None:
        s = engine.core.scheduler
        running = sorted({r.lora_request.lora_name for r in s.running if r.lora_request is not None})
        waiting = sorted(
            {
                r.lora_request.lora_name
                for r in s.requests.values()
                if r.lora_request is not None and r.status.name in ("WAITING", "PREEMPTED")
            }
        )
        labels = (str(engine.config.lora_config.max_loras), ",".join(running), ",".join(waiting))
        if labels != self._lora_labels:
            if self._lora_labels is not None:
                self.lora_info.remove(*self._lora_labels)
            self.lora_info.labels(*labels).set(time.time())
            self._lora_labels = labels
