"""Request traces: OpenTelemetry spans (in-memory exporter, and OTLP/HTTP from a live server)."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading

import pytest

from pagedllm import LLM, SamplingParams

from utils import Server

pytest.importorskip("opentelemetry.sdk")


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return str(tiny_model_factory("llama"))


def test_one_span_per_request_with_chunks_preemptions_and_first_token(model_dir):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pagedllm.engine.trace import OtelRequestTracer

    exporter = InMemorySpanExporter()
    llm = LLM(model_dir, max_model_len=128, num_gpu_blocks_override=8, max_num_batched_tokens=16)
    engine = llm.llm_engine
    tracer = OtelRequestTracer(None, "tiny", exporter=exporter)
    prompts = ["The river town " * 8, "Hello", "One two three four five six seven eight nine ten"]
    params = [
        SamplingParams(max_tokens=60, temperature=0),
        SamplingParams(max_tokens=50, n=2, seed=1),
        SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, seed=2),
    ]
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished_requests():
        tracer.on_step(engine, engine.step())
    assert engine.core.scheduler.num_preemptions > 0  # 8 blocks of 16 tokens for 4 sequences
    spans = {s.attributes["gen_ai.request.id"]: s for s in exporter.get_finished_spans()}
    assert set(spans) == set(ids) and all(s.name == "llm_request" for s in spans.values())
    long = spans[ids[0]]
    chunks = [e for e in long.events if e.name == "prefill_chunk"]
    assert (
        len(chunks) >= 2
        and sum(e.attributes["tokens"] for e in chunks) >= long.attributes["gen_ai.usage.prompt_tokens"]
    )
    assert sum(s.attributes["pagedllm.num_preemptions"] for s in spans.values()) > 0
    for s in spans.values():
        a = s.attributes
        assert a["gen_ai.usage.completion_tokens"] > 0 and a["gen_ai.latency.time_to_first_token"] > 0
        assert a["gen_ai.latency.e2e"] >= a["gen_ai.latency.time_to_first_token"]
        assert "gen_ai.latency.time_in_queue" in a and a["gen_ai.response.finish_reasons"]
        assert any(e.name == "first_token" for e in s.events)
        assert s.start_time < s.end_time
    assert spans[ids[1]].attributes["gen_ai.usage.num_sequences"] == 2
    assert spans[ids[2]].attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert tracer._params == {} and tracer._chunks == {}  # nothing kept after the requests


class Collector:
    """A small OTLP/HTTP receiver: the spans servers export to it, decoded."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        received = self.spans = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        received.extend(ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/traces"

    def stop(self):
        self.httpd.shutdown()


def test_server_exports_spans_over_otlp_http(model_dir):
    collector = Collector()
    s = Server(model_dir, "--otlp-traces-endpoint", collector.url)
    try:
        import openai

        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
        ids = {
            c.completions.create(model="tiny", prompt="Hi there", max_tokens=5).id,
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4).id,
        }
    finally:
        assert s.stop() == 0  # shutdown flushes the batch processor
        collector.stop()
    attrs = [{kv.key: kv.value for kv in span.attributes} for span in collector.spans]
    got = {a["gen_ai.request.id"].string_value for a in attrs}
    assert ids <= got and all(span.name == "llm_request" for span in collector.spans)
    assert all(span.parent_span_id == b"" for span in collector.spans)  # no traceparent sent: a root span
    assert all(a["gen_ai.usage.completion_tokens"].int_value > 0 for a in attrs)


def test_bench_serve_trace_links_the_slowest_requests_to_their_spans(model_dir, tmp_path):
    """`pagedllm bench serve --trace`: each request carries its own traceparent, the server's span joins
    that trace, and the report's slowest requests name trace ids that the collector received."""
    collector = Collector()
    s = Server(model_dir, "--otlp-traces-endpoint", collector.url)
    result = tmp_path / "bench.json"
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pagedllm.entrypoints.cli",
                "bench",
                "serve",
                "--base-url",
                s.url,
                "--num-prompts",
                "8",
                "--random-input-len",
                "24",
                "--random-output-len",
                "6",
                "--max-concurrency",
                "4",
                "--trace",
                "--slowest",
                "3",
                "--result-file",
                str(result),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
    finally:
        assert s.stop() == 0  # flushes the spans
        collector.stop()
    slowest = json.loads(result.read_text())["slowest_requests"]
    assert len(slowest) == 3 and slowest[0]["e2el_ms"] >= slowest[1]["e2el_ms"] >= slowest[2]["e2el_ms"]
    spans = {span.trace_id.hex(): span for span in collector.spans}
    assert len(spans) == 8  # one trace per request: none shared, none dropped
    for slow in slowest:
        span = spans[slow["trace_id"]]  # the bench's trace holds the server's span ...
        attrs = {kv.key: kv.value for kv in span.attributes}
        assert attrs["gen_ai.request.id"].string_value == slow["request_id"]  # ... of that very request
        assert len(span.parent_span_id) == 8 and span.parent_span_id != bytes(8)  # a child of the bench's span
        assert attrs["gen_ai.usage.completion_tokens"].int_value == slow["output_tokens"]
