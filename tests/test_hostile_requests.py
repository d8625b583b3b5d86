"""One request must never take the server down.

Every abusive request gets a 4xx in well under a second, naming what was wrong,
while a concurrent normal stream keeps producing tokens, /health keeps
answering, and memory stays flat. The bounds below are liveness limits (a hung
or saturated event loop misses them by orders of magnitude), not performance
targets.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from utils import MODEL, Server

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BASE = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
MESSAGES = [{"role": "user", "content": "hi"}]

# name -> (endpoint, JSON body, the field the 400 must name)
HOSTILE = {
    "n of a billion": (COMPLETIONS, {**BASE, "n": 10**9}, "n"),
    "n of 5000": (COMPLETIONS, {**BASE, "n": 5000}, "n"),
    "10,000 prompts": (COMPLETIONS, {**BASE, "prompt": ["hi"] * 10_000}, "prompt"),
    "prompts x n": (COMPLETIONS, {**BASE, "prompt": ["hi"] * 100, "n": 100}, "n"),
    "100,000 stop strings": (COMPLETIONS, {**BASE, "stop": [f"s{i}" for i in range(100_000)]}, "stop"),
    "a 200,000-character stop string": (COMPLETIONS, {**BASE, "stop": "x" * 200_000}, "stop"),
    "100,000 stop token ids": (COMPLETIONS, {**BASE, "stop_token_ids": [7] * 100_000}, "stop_token_ids"),
    "40,000 logit_bias entries": (
        COMPLETIONS,
        {**BASE, "logit_bias": {str(i): 1 for i in range(40_000)}},
        "logit_bias",
    ),
    "150,000 allowed token ids": (
        COMPLETIONS,
        {**BASE, "allowed_token_ids": list(range(49152)) * 3},
        "allowed_token_ids",
    ),
    "50,000 bad words": (COMPLETIONS, {**BASE, "bad_words": [f"w{i}" for i in range(50_000)]}, "bad_words"),
    "chat n of a billion": (CHAT, {"model": MODEL, "messages": MESSAGES, "n": 10**9}, "n"),
    "100,000 chat messages": (CHAT, {"model": MODEL, "messages": MESSAGES * 100_000}, "messages"),
}

# name -> (raw body, content type, expected status, words the message must contain)
BAD_BODIES = {
    "nested 5,000 deep": (
        b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        "application/json",
        400,
        "nested too deeply",
    ),
    "invalid UTF-8": (b'{"model": "tiny", "prompt": "\xff\xfe"}', "application/json", 400, "UTF-8"),
    "trailing garbage": (b'{"model": "tiny", "prompt": "hi"} trailing', "application/json", 400, "line 1, column 35"),
    "unclosed object": (b'{"model": "tiny",\n "prompt": "hi"', "application/json", 400, "line 2"),
    "wrong content type": (b'{"model": "tiny", "prompt": "hi"}', "text/plain", 400, "Content-Type"),
}


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir)
    yield s
    s.stop()


def _assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:500]
    body = r.json()
    assert set(body) == {"error"} and body["error"]["code"] == status, body
    return body["error"]


_PROBE = httpx.Client(timeout=5)  # one kept-alive client: a fresh one per probe costs the *client* ~30 ms


class _Streamer(threading.Thread):
    """Streams normal completions back to back on two connections, the second started a moment after the
    first, recording when each token arrives. (A 200-token stream of the tiny model lasts about half a
    second: one connection alone can be between two requests for much of the abuse window.)"""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop, self.token_times, self.errors = url, threading.Event(), [], []

    def run(self) -> None:
        second = threading.Thread(target=self._loop, daemon=True)
        second.start()
        time.sleep(0.25)
        self._loop()
        second.join(30)

    def _loop(self) -> None:
        with httpx.Client(timeout=30) as h:
            while not self.stop.is_set():
                body = {**BASE, "prompt": "a normal request", "max_tokens": 200, "stream": True, "ignore_eos": True}
                try:
                    with h.stream("POST", f"{self.url}{COMPLETIONS}", json=body) as r:
                        for line in r.iter_lines():
                            if line.startswith("data: {"):
                                self.token_times.append(time.perf_counter())
                            if self.stop.is_set():
                                break
                except httpx.HTTPError as e:
                    self.errors.append(repr(e))

    def __enter__(self) -> _Streamer:
        self.start()
        deadline = time.time() + 30
        while not self.token_times and time.time() < deadline:
            time.sleep(0.01)
        assert self.token_times, "the normal stream never started"
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join(30)


# A cheap request the server refuses at once (the baseline every hostile answer is measured against).
_CHEAP = (COMPLETIONS, {**BASE, "temperature": -1}, "temperature")


class _Timings:
    """Latencies of one window: /health probes and refused requests. Each bound below is a ratio against
    the same quantities measured in this test on this machine at this moment (with a floor), so a machine
    that is busy with other work slows both sides alike, while a request that does work in proportion to
    a number it chose, or that blocks the event loop, still misses by orders of magnitude."""

    def __init__(self) -> None:
        self.health: list[float] = []
        self.answers: list[tuple[str, float]] = []

    def probe(self, url: str) -> None:
        t0 = time.perf_counter()
        assert _PROBE.get(f"{url}/health").status_code == 200
        self.health.append(time.perf_counter() - t0)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _post(h: httpx.Client, url: str, payload: bytes, ctype: str = "application/json") -> tuple[httpx.Response, float]:
    t0 = time.perf_counter()
    r = h.post(url, content=payload, headers={"content-type": ctype})
    return r, time.perf_counter() - t0


def _cheap_once(server: Server, h: httpx.Client, timings: _Timings) -> None:
    """The baseline round: as many cheap refused requests and probes as an abuse round sends."""
    endpoint, body, param = _CHEAP
    for _ in range(len(HOSTILE) + len(BAD_BODIES)):
        r, elapsed = _post(h, f"{server.url}{endpoint}", json.dumps(body).encode())
        assert _assert_openai_error(r, 400)["param"] == param
        timings.answers.append(("cheap", elapsed))
        timings.probe(server.url)


def _abuse_once(server: Server, h: httpx.Client, timings: _Timings) -> None:
    """Every hostile request and bad body once: each refused with its error, /health probed after each."""
    for name, (endpoint, body, param) in HOSTILE.items():
        r, elapsed = _post(h, f"{server.url}{endpoint}", json.dumps(body).encode())
        err = _assert_openai_error(r, 400)
        assert err["param"] == param, (name, err)
        assert "limit" in err["message"], (name, err)
        timings.answers.append((name, elapsed))
        timings.probe(server.url)
    for name, (raw, ctype, status, words) in BAD_BODIES.items():
        r, elapsed = _post(h, f"{server.url}{COMPLETIONS}", raw, ctype)
        assert words in _assert_openai_error(r, status)["message"], name
        timings.answers.append((name, elapsed))
        timings.probe(server.url)


def _window(streamer: _Streamer, server: Server, h: httpx.Client, round_fn, seconds: float) -> tuple:
    """Rounds of ``round_fn`` for ``seconds``; returns (timings, the stream's tokens per second, its longest gap)."""
    timings = _Timings()
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        round_fn(server, h, timings)
    end = time.perf_counter()
    during = sorted(t for t in streamer.token_times if start <= t <= end)
    gaps = [b - a for a, b in zip([start] + during, during + [end])]
    return timings, len(during) / (end - start), max(gaps)


def test_each_abusive_request_is_refused_fast_while_others_are_served(server):
    for endpoint, body, _ in HOSTILE.values():  # warm up both endpoints and the allocator
        httpx.post(f"{server.url}{endpoint}", json=body, timeout=30)
    rss_before = server.rss_bytes()
    with _Streamer(server.url) as streamer, httpx.Client(timeout=60) as h:
        # the same normal stream beside cheap refused requests, then beside the abuse: each window is rounds
        # for two seconds (one round is ~0.25 s, too short to tell a stalled stream from a hiccup of the box)
        base, base_rate, base_gap = _window(streamer, server, h, _cheap_once, 2.0)
        abuse, rate, gap = _window(streamer, server, h, _abuse_once, 2.0)
        if gap >= max(1.0, 4 * base_gap):
            # a stall the abuse causes comes back every time it is sent; one the box causes (a busy machine
            # descheduling the server for a second) does not: both windows once more, and the second pair counts
            # (the bound stays the first baseline's, or the second's where that is tighter)
            print(f"a gap of {gap:.2f}s beside abuse vs {base_gap:.2f}s: measuring both windows again")
            first_gap = base_gap
            base, base_rate, base_gap = _window(streamer, server, h, _cheap_once, 2.0)
            base_gap = min(base_gap, first_gap)
            abuse, rate, gap = _window(streamer, server, h, _abuse_once, 2.0)
        time.sleep(0.3)
    report = (
        f"stream {rate:.0f} tok/s beside abuse vs {base_rate:.0f} beside cheap requests; longest gap "
        f"{gap:.2f}s vs {base_gap:.2f}s; /health median {_median(abuse.health) * 1e3:.1f} ms vs "
        f"{_median(base.health) * 1e3:.1f} ms"
    )
    print(report)
    # the stream keeps a fair share of the rate it has on this machine now, and never stalls
    assert rate >= 0.2 * base_rate, report
    assert gap < max(1.0, 4 * base_gap), report
    # /health stays as responsive as it is beside cheap traffic; each abusive answer costs no more than a few
    # times a cheap refusal (a body of megabytes is parsed, but nothing grows with the numbers inside it)
    base_health, base_answer = _median(base.health), _median([t for _, t in base.answers])
    assert _median(abuse.health) < max(0.1, 5 * base_health), report
    assert max(abuse.health) < max(1.0, 50 * base_health), report
    for name, elapsed in abuse.answers:
        assert elapsed < max(1.0, 50 * base_answer), f"{name}: answered in {elapsed:.2f}s; {report}"
    assert not streamer.errors, streamer.errors
    assert server.rss_bytes() - rss_before < 100 << 20
    deadline = time.time() + 10  # the stream the client just dropped is aborted when the server notices
    while server.metric("pagedllm:num_requests_running") > 0 and time.time() < deadline:
        time.sleep(0.05)
    assert server.metric("pagedllm:num_requests_running") == 0


def test_chunked_body_over_the_limit_is_413_without_content_length(model_dir):
    s = Server(model_dir, "--max-request-body-bytes", "100000")
    try:

        def chunks():
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(100):
                yield b"x" * 10_000
            yield b'"}'

        r = httpx.post(f"{s.url}{COMPLETIONS}", content=chunks(), headers={"content-type": "application/json"})
        assert "100000 bytes" in _assert_openai_error(r, 413)["message"]
        assert httpx.get(f"{s.url}/health").status_code == 200
    finally:
        s.stop()


@pytest.mark.parametrize("n", ["1000", 1000.0, "1e9"])
def test_n_must_be_a_json_integer(server, n):
    """Lax coercion would turn these into n=1000 after the limit check read them as 1."""
    err = _assert_openai_error(httpx.post(f"{server.url}{COMPLETIONS}", json={**BASE, "n": n}), 400)
    assert err["param"] == "n"


def test_request_chat_template_needs_the_server_flag(server):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "chat_template": "{% for i in range(99999) %}{{ 'a' * 9999 }}{% endfor %}",
    }
    err = _assert_openai_error(httpx.post(f"{server.url}{CHAT}", json=body), 400)
    assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]


def test_unknown_route_uses_the_openai_error_shape(server):
    err = _assert_openai_error(httpx.post(f"{server.url}/v1/nothing-here", json={}), 404)
    assert err["type"] == "NotFoundError"


def _small_request_while_a_big_one_runs(server: Server, big_body: dict, metric: str, at_least: int) -> tuple:
    """Start ``big_body``; once ``metric`` reaches ``at_least``, stream a small request to its end.

    Returns (the small stream's chunks, whether it finished while the big one still ran, the big response).
    """
    big_done, big_response = threading.Event(), []

    def big():
        big_response.append(httpx.post(f"{server.url}{COMPLETIONS}", json=big_body, timeout=300))
        big_done.set()

    t = threading.Thread(target=big)
    t.start()
    deadline = time.time() + 30
    while server.metric(metric) < at_least and time.time() < deadline:
        time.sleep(0.01)
    assert server.metric(metric) >= at_least, f"the big request never got {metric} to {at_least}"
    with httpx.stream(
        "POST",
        f"{server.url}{COMPLETIONS}",
        timeout=120,
        json={**BASE, "prompt": "small", "max_tokens": 8, "stream": True, "ignore_eos": True},
    ) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        small_finished_first = not big_done.is_set()
    t.join(300)
    return chunks, small_finished_first, big_response[0]


def test_small_stream_gets_tokens_while_an_n_64_request_runs(server):
    """Fair admission: a large but legal request does not hold back a small one behind it."""
    body = {
        **BASE,
        "prompt": "a big request",
        "n": 64,
        "max_tokens": 60,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": 1,
    }
    chunks, small_first, big = _small_request_while_a_big_one_runs(server, body, "pagedllm:num_requests_running", 64)
    assert chunks and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert small_first, "the small stream waited for the n=64 request to finish"
    assert big.json()["usage"]["completion_tokens"] == 64 * 60


def test_small_stream_is_not_queued_behind_a_large_batch(model_dir):
    """Fair admission when sequences are scarce: the batch's prompts and the small request take turns."""
    s = Server(model_dir, "--max-num-seqs", "8")
    try:
        body = {**BASE, "prompt": [f"prompt {i}" for i in range(64)], "max_tokens": 40, "ignore_eos": True}
        chunks, small_first, big = _small_request_while_a_big_one_runs(s, body, "pagedllm:num_requests_waiting", 40)
        assert chunks and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert small_first, "the small request waited behind the whole batch"
        assert big.status_code == 200 and big.json()["usage"]["completion_tokens"] == 64 * 40
    finally:
        s.stop()


def test_every_child_counts_against_max_queue_len(model_dir):
    s = Server(model_dir, "--max-queue-len", "8", "--max-num-seqs", "2")
    try:
        r = httpx.post(f"{s.url}{COMPLETIONS}", json={**BASE, "n": 9})
        assert "max_queue_len=8" in _assert_openai_error(r, 400)["message"]
        with httpx.stream(
            "POST",
            f"{s.url}{COMPLETIONS}",
            timeout=60,
            json={**BASE, "n": 8, "max_tokens": 240, "ignore_eos": True, "stream": True},
        ) as big:
            lines = big.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # 2 running, 6 queued
            full = httpx.post(f"{s.url}{COMPLETIONS}", json={**BASE, "n": 4})
            _assert_openai_error(full, 503)
            assert full.headers["retry-after"]
            assert "queue is full" in full.json()["error"]["message"]
            with httpx.stream("POST", f"{s.url}{COMPLETIONS}", json={**BASE, "n": 2, "stream": True}) as fits:
                assert fits.status_code == 200  # 6 queued + 2 = max_queue_len: admitted
    finally:
        s.stop()


# -- fuzzing: huge and boundary values in every numeric and list field ----------------------

_INTS = st.sampled_from([0, 1, -1, 2, 255, 256, 257, 49151, 49152, 2**31, 2**63, 2**64, 10**30, -(2**63) - 1])
_FLOATS = (
    st.sampled_from([0.0, -0.0, 1e-300, 0.5, 1.0, 2.0, 100.0, 101.0, 1e308, -1e308, float("inf"), float("nan")])
    | st.floats()
)
_SIZES = st.sampled_from([0, 1, 1000, 100_000])


def _big_list(item):
    return st.tuples(_SIZES, item).map(lambda t: [t[1]] * t[0])


_SAMPLING = {
    "max_tokens": _INTS,
    "temperature": _FLOATS,
    "top_p": _FLOATS,
    "n": _INTS,
    "seed": _INTS,
    "presence_penalty": _FLOATS,
    "frequency_penalty": _FLOATS,
    "repetition_penalty": _FLOATS,
    "top_k": _INTS,
    "min_p": _FLOATS,
    "min_tokens": _INTS,
    "priority": _INTS,
    "stop": _big_list(st.sampled_from(["a", "", "x" * 40])) | st.sampled_from(["", "a", "x" * 5000]),
    "stop_token_ids": _big_list(_INTS),
    "allowed_token_ids": _big_list(_INTS),
    "bad_words": _big_list(st.sampled_from(["a", "", "x" * 40])) | st.just(["x" * 5000]),
    "logit_bias": st.tuples(_SIZES, _FLOATS).map(lambda t: {str(i): t[1] for i in range(t[0])}),
}
_COMPLETION_BODY = st.fixed_dictionaries(
    {"model": st.just(MODEL)},
    optional={
        **_SAMPLING,
        "logprobs": _INTS,
        "echo": st.booleans(),
        "prompt": st.one_of(
            _big_list(_INTS),
            _big_list(st.sampled_from(["hi", ""])),
            _big_list(st.just([5, 6])),
            st.sampled_from(["", "hi"]),
        ),
    },
)
_CHAT_BODY = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": _big_list(st.just({"role": "user", "content": "hi"}))},
    optional={**_SAMPLING, "max_completion_tokens": _INTS, "top_logprobs": _INTS, "logprobs": st.booleans()},
)


@pytest.fixture(scope="module")
def fuzz_rss(server):
    """RSS after the first fuzz example of the module, and a place to record the worst seen."""
    return {"first": None, "max": 0}


def _fuzz_one(server, endpoint: str, body: dict, fuzz_rss: dict) -> None:
    body = {**body, "stream": True}
    payload = json.dumps(body).encode()  # NaN / Infinity too, as Python's json writes and reads them
    before, after = _Timings(), _Timings()  # /health just before and after: the bounds scale with the machine
    for _ in range(3):
        before.probe(server.url)
    t0 = time.perf_counter()
    with httpx.stream(
        "POST", f"{server.url}{endpoint}", content=payload, timeout=10, headers={"content-type": "application/json"}
    ) as r:
        elapsed = time.perf_counter() - t0
        status = r.status_code
        if status != 200:
            r.read()
    assert status < 500 or status == 503, (status, r.text[:300] if status != 200 else "")
    if status == 503:  # a full queue may say so; a dead engine may not (it said 503 for every request after)
        assert json.loads(r.text)["error"]["type"] == "server_overloaded", r.text[:300]
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200, health.text  # the engine serves on after every body
    base = _median(before.health)
    assert elapsed < max(2.0, 100 * base), f"took {elapsed:.2f}s to answer (/health: {base * 1e3:.1f} ms)"
    for _ in range(3):
        after.probe(server.url)
    assert _median(after.health) < max(0.1, 20 * base), (after.health, before.health)  # no work left running
    rss = server.rss_bytes()
    fuzz_rss["first"] = fuzz_rss["first"] or rss
    fuzz_rss["max"] = max(fuzz_rss["max"], rss)
    assert rss - fuzz_rss["first"] < 200 << 20, f"RSS grew by {(rss - fuzz_rss['first']) >> 20} MiB"


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(body=_COMPLETION_BODY)
def test_fuzzed_completion_bodies_get_a_fast_answer(server, fuzz_rss, body):
    _fuzz_one(server, COMPLETIONS, body, fuzz_rss)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(body=_CHAT_BODY)
def test_fuzzed_chat_bodies_get_a_fast_answer(server, fuzz_rss, body):
    _fuzz_one(server, CHAT, body, fuzz_rss)


def test_fuzzing_left_the_engine_idle_and_clean(server):
    deadline = time.time() + 30
    while time.time() < deadline and (
        server.metric("pagedllm:num_requests_running") > 0 or server.metric("pagedllm:kv_cache_usage_perc") > 0
    ):
        time.sleep(0.1)
    assert server.metric("pagedllm:num_requests_running") == 0
    assert server.metric("pagedllm:num_requests_waiting") == 0
    assert server.metric("pagedllm:kv_cache_usage_perc") == 0


# -- a mixed abusive load, then SIGTERM while saturated ---------------------------------------

_RETRIES = 30


def test_mixed_abusive_load_then_sigterm_under_load(model_dir):
    s = Server(model_dir, "--max-queue-len", "24", "--max-num-seqs", "8", "--shutdown-timeout", "3")
    rng = random.Random(1234)
    kinds = rng.choices(["normal", "stream", "disconnect", "hostile", "burst"], k=100)

    def one(i: int, kind: str) -> list[tuple[int, float]]:
        t0 = time.perf_counter()
        out = []
        # no read timeout of its own: on a busy machine one answer behind the queue can take minutes, and a hang
        # still fails the bound on every client's total time below
        with httpx.Client(timeout=60 * _RETRIES) as h:
            if kind in ("normal", "stream", "disconnect"):
                # a well-behaved client: on 503 it waits as Retry-After says and tries again, so whether it is
                # served does not depend on how fast this machine drains the queue today
                for _ in range(_RETRIES):
                    if kind == "normal":
                        r = h.post(
                            f"{s.url}{COMPLETIONS}", json={**BASE, "max_tokens": 16, "seed": i, "temperature": 1}
                        )
                    else:
                        body = {**BASE, "max_tokens": 64, "stream": True, "n": 2, "ignore_eos": True}
                        with h.stream("POST", f"{s.url}{COMPLETIONS}", json=body) as r:
                            if r.status_code == 200:
                                for j, _ in enumerate(r.iter_lines()):
                                    if kind == "disconnect" and j == 3:
                                        break  # vanish mid-stream
                            else:
                                r.read()
                    out.append(r.status_code)
                    if r.status_code != 503:
                        break
                    time.sleep(float(r.headers["retry-after"]))
            elif kind == "hostile":
                endpoint, body, _ = HOSTILE[rng.choice(sorted(HOSTILE))]
                out.append(h.post(f"{s.url}{endpoint}", json=body).status_code)
            else:  # a burst past the queue limit
                rs = [h.post(f"{s.url}{COMPLETIONS}", json={**BASE, "n": 6, "max_tokens": 32}) for _ in range(2)]
                out += [r.status_code for r in rs]
                assert all(r.headers.get("retry-after") for r in rs if r.status_code == 503)
        return [(status, time.perf_counter() - t0) for status in out]

    try:
        with ThreadPoolExecutor(12) as pool:
            per_client = [f.result() for f in [pool.submit(one, i, k) for i, k in enumerate(kinds)]]
        results = [x for xs in per_client for x in xs]
        statuses = [st_ for st_, _ in results]
        assert all(st_ < 500 or st_ == 503 for st_ in statuses), statuses
        # every well-behaved client was served in the end (refused only with 503 + Retry-After before that)
        patient = [xs[-1][0] for xs, k in zip(per_client, kinds) if k in ("normal", "stream", "disconnect")]
        assert patient.count(200) == len(patient) >= 40, patient
        assert 400 in statuses and 503 in statuses
        assert max(t for _, t in results) < 60 * _RETRIES
        deadline = time.time() + 15
        while time.time() < deadline and s.metric("pagedllm:kv_cache_usage_perc") > 0:
            time.sleep(0.1)
        assert s.metric("pagedllm:kv_cache_usage_perc") == 0
        assert s.metric("pagedllm:num_requests_running") == 0

        # saturate it again, then SIGTERM: in-flight work is finished or aborted within the timeout
        streams = [
            httpx.stream(
                "POST",
                f"{s.url}{COMPLETIONS}",
                timeout=60,
                json={**BASE, "n": 8, "max_tokens": 240, "ignore_eos": True, "stream": True},
            )
            for _ in range(3)
        ]
        opened = [cm.__enter__() for cm in streams]
        # the gauges move at step ends: the step that admits the first request's 8 completions may report
        # before the engine has taken the other two requests, so wait for the saturated state itself
        deadline, seen = time.time() + 30, (0.0, 0.0)
        while time.time() < deadline and not (seen[0] == 8 and seen[1] > 0):
            time.sleep(0.05)
            seen = (s.metric("pagedllm:num_requests_running"), s.metric("pagedllm:num_requests_waiting"))
        assert seen[0] == 8 and seen[1] > 0, f"(running, waiting) = {seen}"
        t0 = time.time()
        s.proc.send_signal(signal.SIGTERM)
        code = s.proc.wait(60)
        took = time.time() - t0
        for cm in streams:
            try:
                cm.__exit__(None, None, None)
            except httpx.HTTPError:
                pass
        assert opened and code == 0, s.output()[-3000:]
        assert took < 3 + 15, f"SIGTERM took {took:.1f}s"
    finally:
        s.stop()
