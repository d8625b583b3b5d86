"""`pagedllm router` in front of real `pagedllm serve` processes, and `serve --data-parallel-size 2`."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pagedllm.entrypoints.data_parallel import replica_argv
from pagedllm.entrypoints.router import Backend, prefix_key, rendezvous

from utils import MODEL, Server, _free_port, wait_healthy

# How long a test waits for a process or the router to get somewhere before it calls it stuck: a safety net, not a
# measure of speed (the tests wait on what they can see: health, metrics, answers)
PATIENCE_S = 600


class RouterProc:
    def __init__(self, backends: list[str], routing: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "router",
            "--port",
            str(self.port),
            "--routing",
            routing,
            "--health-check-interval",
            "0.3",
        ]
        for b in backends:
            cmd += ["--backend", b]
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        wait_healthy(self.url, self.proc, timeout=PATIENCE_S)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(PATIENCE_S)


def _system(k: int, tag: str) -> str:
    return (
        f"[{tag} system prompt {k}] You are assistant number {k}. Follow the house style guide: short "
        "sentences, no lists, British spelling, and always end with a question back to the user. " * 2
    )


def _workload(tag: str) -> list[str]:
    prompts = [_system(k, tag) + f"Question {q}: say something." for k in range(8) for q in range(8)]
    random.Random(0).shuffle(prompts)
    return prompts


def _send(
    url: str, prompts: list[str], max_tokens: int = 2, concurrency: int = 8, logprobs: int | None = None
) -> list[httpx.Response]:
    with httpx.Client(timeout=120) as client, ThreadPoolExecutor(concurrency) as pool:
        return list(
            pool.map(
                lambda p: client.post(
                    f"{url}/v1/completions",
                    json={
                        "model": MODEL,
                        "prompt": p,
                        "max_tokens": max_tokens,
                        "temperature": 0,
                        "logprobs": logprobs,
                    },
                ),
                prompts,
            )
        )


def _prefix_counts(servers: list[Server]) -> tuple[float, float]:
    return (
        sum(s.metric("pagedllm:prefix_cache_hits_total") for s in servers),
        sum(s.metric("pagedllm:prefix_cache_queries_total") for s in servers),
    )


@pytest.fixture(scope="module")
def backends(tiny_model_factory):
    model = str(tiny_model_factory("llama"))
    servers = [Server(model), Server(model)]
    yield servers
    for s in servers:
        s.stop()


def test_prefix_key_reads_the_first_blocks_and_rendezvous_moves_only_the_lost_keys() -> None:
    assert prefix_key({"prompt": "a" * 300}, 64, 4) == "a" * 256
    assert prefix_key({"prompt": "short"}, 64, 4) == "short"
    assert prefix_key({"messages": [{"role": "user", "content": "x"}]}, 64, 4).startswith('[{"content"')
    three = [Backend("http://a"), Backend("http://b"), Backend("http://c")]
    keys = [f"key {i}" for i in range(300)]
    before = {k: rendezvous(k, three).url for k in keys}
    after = {k: rendezvous(k, three[:2]).url for k in keys}
    assert {k for k in keys if before[k] != after[k]} == {k for k in keys if before[k] == "http://c"}
    assert 60 < sum(v == "http://c" for v in before.values()) < 140  # spread about evenly


def test_the_router_remembers_the_most_recent_response_ids_within_its_bound() -> None:
    from pagedllm.entrypoints.router import Router, RouterConfig

    r = Router(RouterConfig(["http://a", "http://b"], max_response_ids=2))
    r.remember("resp_1", "http://a")
    r.remember("resp_2", "http://b")
    r.remember("resp_1", "http://a")  # used again: the most recent
    r.remember("resp_3", "http://b")
    assert [r.holder(i).url if r.holder(i) else None for i in ("resp_1", "resp_2", "resp_3")] == [
        "http://a",
        None,
        "http://b",
    ]
    assert r.holder(None) is None and r.holder(["not", "an", "id"]) is None
    pinned = {"previous_response_id": "resp_1", "prompt": "x"}
    assert r.choose(pinned, set(), "/v1/responses").url == "http://a"  # healthy or not: only it holds it
    assert r.choose(pinned, {"http://a"}, "/v1/responses") is None  # it failed: no other may answer


def test_requests_that_ended_since_the_last_poll_do_not_count_as_load() -> None:
    b = Backend("http://a", running=2, waiting=1)
    for _ in range(10):  # a burst of short requests, all answered before the next poll
        b.sent()
        b.ended()
    assert b.load == 3
    b.sent()
    assert b.load == 4 and b.in_flight == 1


def test_prefix_aware_routing_hits_the_prefix_cache_more_than_round_robin(backends) -> None:
    rates = {}
    for routing in ("round-robin", "prefix-aware"):
        router = RouterProc([s.url for s in backends], routing)
        try:
            hits0, queries0 = _prefix_counts(backends)
            responses = _send(router.url, _workload(routing))  # a fresh set of system prompts per policy
            hits1, queries1 = _prefix_counts(backends)
        finally:
            router.stop()
        assert all(r.status_code == 200 for r in responses)
        rates[routing] = (hits1 - hits0) / (queries1 - queries0)
    assert rates["prefix-aware"] > rates["round-robin"] + 0.05, rates


def test_killing_a_backend_mid_run_still_completes_every_request(tiny_model_factory) -> None:
    model = str(tiny_model_factory("llama"))
    servers = [Server(model), Server(model)]
    router = RouterProc([s.url for s in servers], "round-robin")
    try:
        prompts = _workload("kill")[:40]
        with ThreadPoolExecutor(1) as killer:

            def kill_soon() -> None:  # mid-run at any machine speed: once backend 1 has answered about two
                deadline = time.monotonic() + PATIENCE_S  # requests (a fixed 1 s was past 30 of the 40 on a fast day)
                while servers[1].metric("pagedllm:generation_tokens_total") < 48 and time.monotonic() < deadline:
                    time.sleep(0.02)
                servers[1].proc.kill()

            killed = killer.submit(kill_soon)
            responses = _send(router.url, prompts[:30], max_tokens=24, concurrency=6)
            killed.result()
        # the last ten go once the backend is dead, however long the first thirty took to answer
        responses += _send(router.url, prompts[30:], max_tokens=24, concurrency=6)
        assert servers[1].proc.poll() is not None, "the backend was not killed during the run"
        assert [r.status_code for r in responses] == [200] * len(prompts)
        assert {r.headers["x-pagedllm-backend"] for r in responses[-10:]} == {servers[0].url}
        metrics = httpx.get(f"{router.url}/metrics").text
        assert "pagedllm_router:retries_total" in metrics
        status = {b["url"]: b["healthy"] for b in httpx.get(f"{router.url}/backends").json()}
        assert status == {servers[0].url: True, servers[1].url: False}
    finally:
        router.stop()
        for s in servers:
            s.stop()


class _CutOffBackend:
    """A backend that looks healthy but dies between an answer's headers and its body."""

    def __init__(self) -> None:
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "1000")
                self.end_headers()
                self.wfile.write(b'{"id": "cmpl-')  # ... and gone
                self.wfile.flush()
                self.close_connection = True

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()


def test_an_answer_cut_off_before_its_body_is_retried_on_another_backend(backends) -> None:
    broken = _CutOffBackend()
    router = RouterProc([broken.url, backends[0].url], "round-robin")
    try:
        responses = _send(router.url, _workload("cut")[:12], concurrency=3)
        assert [r.status_code for r in responses] == [200] * 12, [r.text for r in responses]
        assert {r.headers["x-pagedllm-backend"] for r in responses} == {backends[0].url}
        metrics = httpx.get(f"{router.url}/metrics").text
        broken_line = f'pagedllm_router:requests_total{{backend="{broken.url}",outcome="broken"}} '
        assert float(metrics.split(broken_line)[1].split()[0]) >= 1  # it was tried, and cut off
        assert float(metrics.split("\npagedllm_router:retries_total ")[1].split()[0]) >= 1
    finally:
        router.stop()
        broken.stop()


def test_a_stored_response_is_continued_read_and_deleted_on_the_backend_that_holds_it(backends) -> None:
    """Round-robin would send each request of a conversation to the other backend, which does not hold it: the
    router sends previous_response_id, GET and DELETE where the response lives, learning it from answers
    streamed or not."""
    router = RouterProc([b.url for b in backends], "round-robin")
    body = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    try:
        with httpx.Client(base_url=router.url, timeout=120) as c:
            first = c.post("/v1/responses", json={**body, "input": "Hello"})
            assert first.status_code == 200, first.text
            holder, last = first.headers["x-pagedllm-backend"], first.json()["id"]
            for turn in range(3):
                r = c.post("/v1/responses", json={**body, "input": f"And {turn}?", "previous_response_id": last})
                assert r.status_code == 200, r.text
                assert r.headers["x-pagedllm-backend"] == holder and r.json()["previous_response_id"] == last
                last = r.json()["id"]
            with c.stream(
                "POST", "/v1/responses", json={**body, "input": "Go on.", "previous_response_id": last, "stream": True}
            ) as r:
                assert r.status_code == 200 and r.headers["x-pagedllm-backend"] == holder
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1]["type"] == "response.incomplete"  # max_output_tokens: stored all the same
            streamed = events[0]["response"]["id"]
            again = c.post("/v1/responses", json={**body, "input": "More.", "previous_response_id": streamed})
            assert again.status_code == 200 and again.headers["x-pagedllm-backend"] == holder  # learnt mid-stream
            got = c.get(f"/v1/responses/{streamed}")
            assert got.status_code == 200 and got.json()["id"] == streamed
            assert c.delete(f"/v1/responses/{streamed}").status_code == 200
            assert c.get(f"/v1/responses/{streamed}").status_code == 404
            unknown = c.post("/v1/responses", json={**body, "input": "?", "previous_response_id": "resp_nope"})
            assert unknown.status_code == 400 and "previous_response_id" in unknown.text
    finally:
        router.stop()


def test_replica_argv_drops_the_front_flags() -> None:
    argv = [
        "--log-level",
        "INFO",
        "serve",
        "m",
        "--data-parallel-size",
        "2",
        "--port=9000",
        "--host",
        "0.0.0.0",
        "--max-num-seqs",
        "4",
    ]
    assert replica_argv(argv) == ["--log-level", "INFO", "serve", "m", "--max-num-seqs", "4"]


def test_data_parallel_serve_runs_two_engine_processes_with_single_process_outputs(tiny_model_factory) -> None:
    from pagedllm import LLM, SamplingParams

    model = str(tiny_model_factory("qwen2"))
    prompts = [f"Story number {i}: once upon a time" for i in range(12)]
    llm = LLM(model, max_model_len=256, num_gpu_blocks_override=128)
    ref = [
        o.outputs[0]
        for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, logprobs=1), use_tqdm=False)
    ]
    server = Server(model, "--data-parallel-size", "2")
    try:
        deadline = time.monotonic() + PATIENCE_S
        while not all(b["healthy"] for b in httpx.get(f"{server.url}/backends").json()):
            assert time.monotonic() < deadline, "the replicas did not become healthy"
            time.sleep(0.3)
        responses = _send(server.url, prompts, max_tokens=12, concurrency=6, logprobs=1)
        for r, want in zip(responses, ref):
            choice = r.json()["choices"][0]
            assert choice["text"] == want.text
            got_lp = choice["logprobs"]["token_logprobs"]
            want_lp = [lp[t].logprob for t, lp in zip(want.token_ids, want.logprobs)]
            assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-4
        used = {r.headers["x-pagedllm-backend"] for r in responses}
        assert len(used) == 2  # both replicas served
        replica_pids = [
            int(line)
            for line in subprocess.run(
                ["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True
            ).stdout.split()
        ]
        assert len(replica_pids) == 2
    finally:
        assert server.stop() == 0
    for pid in replica_pids:  # the replicas went with the front
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_blue_green_restart_behind_the_router_drops_nothing(tiny_model_factory) -> None:
    """A replacement server comes up on another port while the old one serves; the old one then drains
    (SIGTERM: stop accepting, finish in flight, exit 0). Every request of a steady stream succeeds."""
    import threading

    model = str(tiny_model_factory("llama"))
    old = Server(model)
    green_port = _free_port()
    router = RouterProc([old.url, f"http://127.0.0.1:{green_port}"], "least-load")
    new: list[Server] = []
    results: list[tuple[bool, httpx.Response]] = []  # (sent after blue had stopped, the answer)
    stopped = threading.Event()
    stop = threading.Event()
    prompts = _workload("bluegreen")

    def client(k: int) -> None:
        with httpx.Client(timeout=120) as c:
            i = k
            while not stop.is_set():
                after = stopped.is_set()
                body = {"model": MODEL, "prompt": prompts[i % len(prompts)], "max_tokens": 16, "temperature": 0}
                results.append((after, c.post(f"{router.url}/v1/completions", json=body)))
                i += 4

    def wait_until(condition, failure: str) -> None:
        deadline = time.monotonic() + PATIENCE_S
        while not condition():
            assert time.monotonic() < deadline, failure
            time.sleep(0.2)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: results, "blue answered nothing")
        new.append(Server(model, port=green_port))  # green comes up while blue serves
        wait_until(
            lambda: all(b["healthy"] for b in httpx.get(f"{router.url}/backends").json()),
            "the router did not see the new server",
        )
        before = len(results)
        assert old.stop() == 0  # blue drains: what it had in flight finishes, then it exits cleanly
        stopped.set()
        # traffic goes on, to green only: at least a round of the four clients sent after the stop
        wait_until(lambda: sum(after for after, _ in results) >= 4, "no traffic after blue stopped")
        stop.set()
        for t in threads:
            t.join(PATIENCE_S)
        assert len(results) > before > 0
        assert [r.status_code for _, r in results] == [200] * len(results)
        served_by = [r.headers["x-pagedllm-backend"] for _, r in results]
        assert set(served_by) == {old.url, new[0].url}
        assert {r.headers["x-pagedllm-backend"] for after, r in results if after} == {new[0].url}
    finally:
        stop.set()
        router.stop()
        for s in [old, *new]:
            s.stop()


def test_router_refuses_hostile_bodies_and_keeps_routing(backends) -> None:
    router = RouterProc([s.url for s in backends], "round-robin")
    try:
        with httpx.Client(base_url=router.url, timeout=60) as c:
            huge = c.post(
                "/v1/completions",
                content=b'{"prompt": "' + b"a" * (10 << 20) + b'"}',
                headers={"content-type": "application/json"},
            )
            assert huge.status_code == 413
            deep = c.post("/v1/completions", content=b"[" * 100_000, headers={"content-type": "application/json"})
            assert deep.status_code == 400 and "nested" in deep.text
            assert c.post("/v1/completions", json=[1, 2]).status_code == 400
            assert (
                c.post("/v1/completions", content=b"\xff{", headers={"content-type": "application/json"}).status_code
                == 400
            )
            unknown = c.post("/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 1})
            assert unknown.status_code == 404  # the backend's own answer, passed through
            ok = c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200
    finally:
        router.stop()


def test_the_router_closes_half_sent_requests_and_keeps_its_backends_list_behind_the_key() -> None:
    """The front door of `router`, `disagg-proxy` and `serve --data-parallel-size` bounds connections as `serve`
    does: half a header is closed, a stalled body gets a 408, within their deadlines. No backend is needed."""
    import socket

    port = _free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "router", "--port", str(port), "--api-key", "k"]
    cmd += ["--backend", "http://127.0.0.1:9", "--request-header-timeout", "2", "--request-body-timeout", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        # up: its /health is 503 with no backend healthy, its open /metrics says it listens
        wait_healthy(url, proc, PATIENCE_S, path="/metrics")
        assert httpx.get(f"{url}/backends").status_code == 401
        assert httpx.get(f"{url}/backends", headers={"Authorization": "Bearer k"}).json()[0]["url"]
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
        head += b"Content-Type: application/json\r\n"
        header_only, body = (socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(2))
        header_only.sendall(head[:40])
        body.sendall(head + b"Content-Length: 100\r\n\r\n" + b'{"prompt": "')
        started = time.monotonic()
        answers = []
        for s in (header_only, body):
            got = b""
            while chunk := s.recv(65536):  # until the router closes it
                got += chunk
            answers.append(got)
            s.close()
        assert time.monotonic() - started < 25  # 2 s deadlines; the recv timeout (30 s) would fail first otherwise
        assert answers[0] == b"" and answers[1].startswith(b"HTTP/1.1 408"), answers
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(PATIENCE_S)
