"""``--trace-file``: the engine's steps and requests as a Chrome / Perfetto trace (JSON array format).

Open the file in ``chrome://tracing`` or https://ui.perfetto.dev. Track "engine" holds
one slice per step (its decode and prefill tokens, running and waiting counts); each
request is an async slice from arrival to finish with instants for "scheduled" and
"first token", and its token counts and finish reason. Events are built on the engine
thread from what the step already produced, and a writer thread does the file I/O,
so the engine never waits on the disk. The array is closed at shutdown; a file cut
short by a crash still opens (both viewers accept a missing ``]``).
"""

from __future__ import annotations

import json
import os
import queue
import threading
from typing import Any

_PID = 1
_ENGINE_TID = 1


class ChromeTraceWriter:
    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "w", encoding="utf-8")  # noqa: SIM115 -- closed by close()
        self._f.write('[{"ph": "M", "pid": 1, "tid": 1, "name": "thread_name", "args": {"name": "engine"}}')
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._seen: dict[str, bool] = {}  # requests whose begin event is out -> their first token is too
        self._last_step = 0.0
        self._thread = threading.Thread(target=self._write, name="pagedllm-trace", daemon=True)
        self._thread.start()

    def on_step(self, engine: Any, outputs: list) -> None:
        """Called on the engine thread after each step."""
        events = []
        core = engine.core
        if core.step_history and core.step_history[-1][0] > self._last_step:
            t, dt, decode, prefill = core.step_history[-1]
            self._last_step = t
            events.append(
                {
                    "ph": "X",
                    "pid": _PID,
                    "tid": _ENGINE_TID,
                    "name": "step",
                    "ts": _us(t),
                    "dur": _us(dt),
                    "args": {
                        "decode_tokens": decode,
                        "prefill_tokens": prefill,
                        "running": len(core.scheduler.running),
                        "waiting": core.scheduler.num_waiting_requests(),
                    },
                }
            )
        for out in outputs:
            rid, m = out.request_id, out.metrics
            common = {"pid": _PID, "cat": "request", "id": rid, "name": "request"}
            if rid not in self._seen:
                self._seen[rid] = False
                events.append(
                    {
                        **common,
                        "ph": "b",
                        "ts": _us(m.arrival_time),
                        "args": {"request_id": rid, "prompt_tokens": len(out.prompt_token_ids)},
                    }
                )
                if m.first_scheduled_time is not None:
                    events.append({**common, "ph": "n", "name": "scheduled", "ts": _us(m.first_scheduled_time)})
            if not self._seen[rid] and m.first_token_time is not None:
                self._seen[rid] = True
                events.append({**common, "ph": "n", "name": "first token", "ts": _us(m.first_token_time)})
            if out.finished:
                del self._seen[rid]
                end = m.finished_time or m.last_token_time or m.arrival_time
                completions = out.outputs if isinstance(out.outputs, list) else []  # a pooling request: none
                events.append(
                    {
                        **common,
                        "ph": "e",
                        "ts": _us(end),
                        "args": {
                            "finish_reason": [c.finish_reason for c in completions],
                            "output_tokens": sum(len(c.token_ids) for c in completions),
                            "cached_prompt_tokens": out.num_cached_tokens,
                        },
                    }
                )
        if events:
            self._q.put(events)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)

    def _write(self) -> None:
        while True:
            events = self._q.get()
            if events is None:
                break
            self._f.write("".join(",\n" + json.dumps(e) for e in events))
            self._f.flush()
        self._f.write("]\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 1)


class OtelRequestTracer:
    """``--otlp-traces-endpoint``: one OpenTelemetry span per request, with vLLM's attribute names.

    Span ``llm_request`` (kind SERVER) from arrival to finish: ``gen_ai.request.id``,
    ``gen_ai.response.model``, ``gen_ai.request.{max_tokens,temperature,top_p,n}``,
    ``gen_ai.usage.{prompt_tokens,completion_tokens,num_sequences}``,
    ``gen_ai.latency.{time_in_queue,time_to_first_token,e2e}``, and
    ``gen_ai.response.finish_reasons``; pagedllm's own ``pagedllm.num_preemptions`` and
    ``pagedllm.cached_prompt_tokens``. Events: each prefill chunk (``prefill_chunk`` with its
    tokens), each resumption after a preemption, and the first token. A request that carries a W3C
    ``traceparent`` header gets its span in that trace, as a child of the client's span. Spans are exported
    by the SDK's batch processor on its own thread.
    """

    def __init__(self, endpoint: str | None, model_name: str, exporter: Any = None):
        try:
            import opentelemetry.sdk  # noqa: F401
        except ImportError:
            from pagedllm.errors import InvalidParameterError

            raise InvalidParameterError(
                "--otlp-traces-endpoint needs opentelemetry-sdk and "
                "opentelemetry-exporter-otlp-proto-http: pip install 'pagedllm[otel]'",
                "otlp_traces_endpoint",
            ) from None
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        processor: SpanProcessor
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint)
            processor = BatchSpanProcessor(exporter)
        else:  # tests hand an in-memory exporter: export at once
            processor = SimpleSpanProcessor(exporter)
        self.provider = TracerProvider(resource=Resource.create({"service.name": "pagedllm"}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("pagedllm")
        self.model_name = model_name
        # per (child) request: prefill chunks [(monotonic time, tokens)], preemptions seen, preemption times
        self._chunks: dict[str, list[tuple[float, int]]] = {}
        self._preempted: dict[str, list[float]] = {}
        self._params: dict[str, Any] = {}
        self._headers: dict[str, dict[str, str]] = {}  # the client's trace context, per (child) request

    def on_step(self, engine: Any, outputs: list) -> None:
        core = engine.core
        if core.step_history:
            now = core.step_history[-1][0]
            for rid, n in core.last_scheduled.items():
                req = core.scheduler.requests.get(rid)
                if req is None:
                    continue
                if rid not in self._params:
                    self._params[rid] = req.sampling_params
                    if req.trace_headers:
                        self._headers[rid] = req.trace_headers
                if req.num_computed_tokens <= req.num_prompt_tokens:  # this step computed part of the prompt
                    self._chunks.setdefault(rid, []).append((now, n))
                times = self._preempted.setdefault(rid, [])
                while len(times) < req.num_preemptions:
                    times.append(now)
        for out in outputs:
            if out.finished:
                self._span(engine, out)

    def _span(self, engine: Any, out: Any) -> None:
        import time

        from opentelemetry.trace import SpanKind

        m = out.metrics
        completions = out.outputs if isinstance(out.outputs, list) else []  # a pooling request: none
        wall = time.time_ns() - time.monotonic_ns()
        ns = lambda t: int(t * 1e9) + wall  # noqa: E731
        children = [c for c in self._params if c == out.request_id or c.endswith("_" + out.request_id)]
        end = m.finished_time or m.last_token_time or m.arrival_time
        headers = next((h for c in children if (h := self._headers.get(c))), None)
        context = None
        if headers:  # the span joins the client's trace (what `pagedllm bench serve --trace` sends)
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            context = TraceContextTextMapPropagator().extract(carrier=headers)
        span = self.tracer.start_span(
            "llm_request", kind=SpanKind.SERVER, start_time=ns(m.arrival_time), context=context
        )
        params = self._params.get(children[0]) if children else None
        attrs = {
            "gen_ai.request.id": out.request_id,
            "gen_ai.response.model": self.model_name,
            "gen_ai.usage.prompt_tokens": len(out.prompt_token_ids),
            "gen_ai.usage.completion_tokens": sum(len(c.token_ids) for c in completions),
            "gen_ai.usage.num_sequences": len(completions),
            "gen_ai.request.n": len(completions),
            "gen_ai.response.finish_reasons": [c.finish_reason or "abort" for c in completions],
            "gen_ai.latency.e2e": end - m.arrival_time,
            "pagedllm.cached_prompt_tokens": max(out.num_cached_tokens, 0),
        }
        if params is not None:
            attrs.update(
                {
                    "gen_ai.request.max_tokens": params.max_tokens or 0,
                    "gen_ai.request.temperature": params.temperature,
                    "gen_ai.request.top_p": params.top_p,
                }
            )
        if m.time_in_queue is not None:
            attrs["gen_ai.latency.time_in_queue"] = m.time_in_queue
        if m.first_token_time is not None:
            attrs["gen_ai.latency.time_to_first_token"] = m.first_token_time - m.arrival_time
            span.add_event("first_token", timestamp=ns(m.first_token_time))
        preemptions = 0
        for c in dict.fromkeys(children):
            for t, n in self._chunks.pop(c, []):
                span.add_event("prefill_chunk", {"tokens": n, "sequence": c}, timestamp=ns(t))
            times = self._preempted.pop(c, [])
            self._params.pop(c, None)
            self._headers.pop(c, None)
            preemptions += len(times)
            for t in times:  # seen when the sequence is scheduled again
                span.add_event("resumed_after_preemption", {"sequence": c}, timestamp=ns(t))
        attrs["pagedllm.num_preemptions"] = preemptions
        span.set_attributes(attrs)
        span.end(end_time=ns(end))

    def close(self) -> None:
        self.provider.shutdown()  # flushes what is batched
