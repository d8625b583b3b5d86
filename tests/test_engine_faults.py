"""Nothing a client sends can stop the engine.

Values that used to reach the engine and kill its loop are refused at the boundary (offline with
InvalidParameterError, over HTTP with a 400 naming the field); a row with no valid token fails its request
alone; a step that raises costs at most the request that caused it; a fault no request can be blamed for
rebuilds the engine core in-process, and the engine serves on.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.errors import EngineDeadError, InvalidParameterError, RequestFailedError

from utils import check_engine_clean

BIG = 2**70  # past 64 bits: "Overflow when unpacking long long" where it reached a tensor
PROMPTS = [f"Story {i}: once upon a time there was" for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=model_dir, max_model_len=128, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def reference(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"top_k": BIG}, "top_k"),
        ({"seed": BIG}, "seed"),
        ({"seed": -BIG}, "seed"),
        ({"n": BIG}, "n"),
        ({"max_tokens": BIG}, "max_tokens"),
        ({"min_tokens": BIG, "max_tokens": None}, "min_tokens"),
        ({"logprobs": BIG}, "logprobs"),
        ({"prompt_logprobs": BIG}, "prompt_logprobs"),
        ({"truncate_prompt_tokens": BIG}, "truncate_prompt_tokens"),
        ({"stop_token_ids": [BIG]}, "stop_token_ids"),
        ({"allowed_token_ids": [BIG]}, "allowed_token_ids"),
        ({"logit_bias": {BIG: 1.0}}, "logit_bias"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 1e308}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 1e308}, "repetition_penalty"),
        ({"presence_penalty": float("-inf")}, "presence_penalty"),
        ({"stop": ["ok", "\ud800"]}, "stop"),
        ({"bad_words": ["\udfff"]}, "bad_words"),
    ],
)
def test_values_the_engine_cannot_represent_are_refused_naming_them(kwargs, param):
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param, e.value


def test_a_tiny_temperature_is_raised_to_the_floor_not_divided_by():
    assert SamplingParams(temperature=1e-300).temperature == 1e-2
    assert SamplingParams(temperature=0).temperature == 0


def test_masks_that_leave_no_first_token_are_refused_and_the_engine_serves_on(llm, reference):
    eos = llm.get_tokenizer().eos_token_id
    with pytest.raises(InvalidParameterError, match="min_tokens") as e:
        llm.generate(["hi"], SamplingParams(allowed_token_ids=[eos], min_tokens=4, max_tokens=8), use_tqdm=False)
    assert e.value.param == "allowed_token_ids"
    word = " hello"
    (tid,) = llm.get_tokenizer().encode(word, add_special_tokens=False)
    with pytest.raises(InvalidParameterError, match="bad_words bans every token"):
        llm.generate(["hi"], SamplingParams(allowed_token_ids=[tid], bad_words=[word.strip()]), use_tqdm=False)
    check_engine_clean(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference


def test_a_prompt_with_a_lone_surrogate_is_refused(llm):
    with pytest.raises(InvalidParameterError, match="not valid Unicode") as e:
        llm.generate(["fine \ud800 text"], GREEDY, use_tqdm=False)
    assert e.value.param == "prompt"
    check_engine_clean(llm)


def _no_token(output_ids, logits):  # a mask that leaves nothing: as a grammar can at some step
    return logits.fill_(float("-inf"))


def test_a_row_with_no_valid_token_fails_its_request_alone(llm, reference):
    params = [GREEDY] * len(PROMPTS)
    params[1] = SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, logits_processors=[_no_token], n=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [c.finish_reason for c in outs[1].outputs] == ["error", "error"]
    assert "no valid token" in outs[1].outputs[0].stop_reason
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 1] == reference[:1] + reference[2:]
    check_engine_clean(llm)


def _fault_on_request(engine, culprit: str):
    """Raise inside every step that computes a child of ``culprit``'s prompt (the model's step, so isolable)."""
    requests = engine.core.scheduler.requests

    def hook(stage, sched_out):
        if stage == "execute" and any(requests[r].parent_id == culprit for r in sched_out.num_scheduled_tokens):
            raise RuntimeError("injected fault")

    return hook


def test_a_fault_in_one_requests_step_costs_only_that_request(llm, reference):
    engine = llm.llm_engine
    for p in PROMPTS:  # prefix-cache the prompts: a step's partial writes must not be found later
        engine.add_request(f"warm-{p}", p, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    ids = [f"req-{i}" for i in range(len(PROMPTS))]
    for rid, p in zip(ids, PROMPTS):
        engine.add_request(rid, p, GREEDY)
    engine.fault_hook = _fault_on_request(engine, "req-2")
    try:
        finals = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
    finally:
        engine.fault_hook = None
    assert finals["req-2"].outputs[0].finish_reason == "error"
    assert "injected fault" in finals["req-2"].outputs[0].stop_reason
    assert [finals[r].outputs[0].token_ids for r in ids if r != "req-2"] == reference[:2] + reference[3:]
    assert not engine.core.scheduler.suspects
    check_engine_clean(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference


def _async_llm(model_dir, **kwargs):
    from pagedllm.engine.async_llm import AsyncLLM

    return AsyncLLM.from_kwargs(model=model_dir, max_model_len=128, num_gpu_blocks_override=64, **kwargs)


async def _collect(llm, prompt: str, params=GREEDY, request_id: str | None = None):
    last = None
    async for out in llm.generate(prompt, params, request_id):
        last = out
    return last


def test_an_unattributable_fault_rebuilds_the_engine_core_and_it_serves_on(model_dir, reference):
    from pagedllm.engine import async_llm

    restarts, dead = [], []
    llm = _async_llm(model_dir)
    llm.on_restart, llm.on_dead = lambda: restarts.append(1), dead.append
    fired: list[set[str]] = []  # the requests in flight (streams open) when the fault fired
    failed: list[set[str]] = []  # the streams the restart ended: those, and any registered before it failed them
    fail_streams = llm._fail_streams

    def recorded(error):
        ids = fail_streams(error)
        failed.append(set(ids))
        return ids

    llm._fail_streams = recorded

    def once(stage, sched_out):  # raises once, after the model ran: the engine cannot tell whose fault it was
        if stage == "update" and not fired:
            fired.append(set(llm._streams))  # every stream open now is told the engine restarted
            raise RuntimeError("injected unattributable fault")

    async def run():
        llm.engine.fault_hook = once
        ids = [f"p{i}" for i in range(len(PROMPTS))]
        results = await asyncio.gather(
            *(_collect(llm, p, request_id=rid) for p, rid in zip(PROMPTS, ids)), return_exceptions=True
        )
        assert fired and fired[0], "the fault never fired"
        # every stream open at the fault was failed; so was any registered between the fault and the restart's
        # failing (on a busy machine); a request that came after the rebuild got its tokens
        assert failed and fired[0] <= failed[0], (fired, failed)
        for rid, r, want in zip(ids, results, reference):
            if rid in failed[0]:
                assert isinstance(r, RequestFailedError), (rid, r)
            else:
                assert r.outputs[0].token_ids == want, (rid, r)
        assert restarts == [1] and not dead and llm.dead is None and not llm.restarting
        after = await asyncio.gather(*(_collect(llm, p) for p in PROMPTS))
        assert [o.outputs[0].token_ids for o in after] == reference
        s = llm.engine.core.scheduler
        s.check_invariants()
        assert s.kv.pool.num_free_blocks == s.kv.num_blocks
        # a fault on every step: after MAX_RESTARTS rebuilds in the window the engine gives up, and says so
        llm.engine.fault_hook = lambda stage, so: (
            (_ for _ in ()).throw(RuntimeError("always")) if stage == "update" else None
        )
        for _ in range(async_llm.MAX_RESTARTS):
            with pytest.raises((RequestFailedError, EngineDeadError)):
                await _collect(llm, PROMPTS[0])
        assert len(restarts) == async_llm.MAX_RESTARTS and len(dead) == 1
        with pytest.raises(EngineDeadError):
            await _collect(llm, PROMPTS[0])

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()


# -- over HTTP ---------------------------------------------------------------------------------------------------

KEY = "sk-faults"
MODEL = "tiny"


@pytest.fixture(scope="module")
def app_client(model_dir):
    from fastapi.testclient import TestClient

    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.openai.server import build_app

    config = EngineConfig.from_kwargs(model=model_dir, max_model_len=128, num_gpu_blocks_override=64)
    app = build_app(lambda: LLMEngine(config), MODEL, api_key=KEY)
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as client:
        deadline = time.monotonic() + 300  # a safety net: it waits on /health
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine did not load"
            time.sleep(0.05)
        yield client, app.state.server


def _ok(client) -> None:
    """A normal request is served after whatever came before."""
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    assert client.get("/health").status_code == 200


C, CHAT = "/v1/completions", "/v1/chat/completions"
PLAIN = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
# name -> (path, body, the field the 400 must name; None: any)
HOSTILE = {
    "top_k past 64 bits": (C, {**PLAIN, "top_k": BIG}, "top_k"),
    "seed past 64 bits": (C, {**PLAIN, "seed": BIG}, "seed"),
    "temperature at float64's edge": (C, {**PLAIN, "temperature": 1.7e308}, "temperature"),
    "repetition penalty near zero": (C, {**PLAIN, "repetition_penalty": 1e-300}, "repetition_penalty"),
    "only EOS allowed, with min_tokens": (
        C,
        {**PLAIN, "allowed_token_ids": ["EOS"], "min_tokens": 2},
        "allowed_token_ids",
    ),
    "a lone surrogate in the prompt": (C, {**PLAIN, "prompt": "hi \ud800"}, "prompt"),
    "a lone surrogate in a message": (
        CHAT,
        {"model": MODEL, "messages": [{"role": "user", "content": "\udc00"}]},
        "messages.0.content",
    ),
    "a lone surrogate in bad_words": (C, {**PLAIN, "bad_words": ["\ud800"]}, "bad_words.0"),
    "a lone surrogate in the model": (C, {**PLAIN, "model": "\ud800"}, "model"),
    "a lone surrogate to /tokenize": ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    "a string token id to /detokenize": ("/detokenize", {"tokens": ["0"]}, None),
    "a boolean token id to /detokenize": ("/detokenize", {"tokens": [True]}, None),
    "a float token id to /detokenize": ("/detokenize", {"tokens": [0.0]}, None),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_each_request_that_stopped_the_engine_is_a_400_and_the_engine_serves_on(app_client, name):
    client, state = app_client
    path, body, param = HOSTILE[name]
    if body.get("allowed_token_ids") == ["EOS"]:
        body = {**body, "allowed_token_ids": [state.llm.engine.tokenizer.eos_token_id]}
    # as JSON escapes ("\\ud800"), the only way a lone surrogate travels
    r = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and error["message"], error
    if param is not None:
        assert error["param"] == param, error
    _ok(client)


def test_a_faulting_request_is_a_500_in_openai_shape_and_others_are_served(app_client):
    client, state = app_client
    engine = state.llm.engine
    tokenizer = engine.tokenizer
    marker = tokenizer.encode("Zebra crossing", add_special_tokens=False)

    def hook(stage, sched_out):
        reqs = engine.core.scheduler.requests
        if stage == "execute" and any(
            reqs[r].prompt_token_ids[: len(marker)] == marker for r in sched_out.num_scheduled_tokens
        ):
            raise RuntimeError("injected fault")

    state.llm.engine.fault_hook = hook
    try:
        bad = client.post("/v1/completions", json={"model": MODEL, "prompt": "Zebra crossing", "max_tokens": 4})
        assert bad.status_code == 500, bad.text
        assert bad.json()["error"]["type"] == "server_error" and "injected fault" in bad.json()["error"]["message"]
        with client.stream(
            "POST",
            "/v1/completions",
            json={"model": MODEL, "prompt": "Zebra crossing", "max_tokens": 4, "stream": True},
        ) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert '"code": 500' in events[-2] and events[-1] == "data: [DONE]", events
        _ok(client)
    finally:
        state.llm.engine.fault_hook = None


def test_an_unattributable_fault_is_counted_and_health_recovers(app_client):
    client, state = app_client
    fired = []

    def once(stage, sched_out):
        if stage == "update" and not fired:
            fired.append(1)
            raise RuntimeError("injected unattributable fault")

    state.llm.engine.fault_hook = once
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 500 and "restarted" in r.json()["error"]["message"], r.text
    metrics = client.get("/metrics").text
    assert f'pagedllm:engine_restarts_total{{model_name="{MODEL}"}} 1.0' in metrics, metrics
    _ok(client)


def _docs_access_table() -> dict[str, bool]:
    """docs/serving/openai.md's endpoint table: each backquoted path -> whether it is open without the key."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "serving" / "openai.md").read_text()
    table = text.split("<!-- endpoint-access -->", 1)[1].split("\n\n", 1)[0]
    access = {}
    for row in table.splitlines()[2:]:
        endpoints, needs = row.strip("|").split("|", 1)
        for path in re.findall(r"`(/[^`*]*)`", endpoints):
            access[path] = needs.strip().startswith("open")
    return access


def test_every_endpoint_that_does_work_needs_the_key(app_client):
    """Every route the app has, and every path the docs' table names, answers 401 without the key, but the open
    ones; the docs' open rows are exactly the code's default."""
    from pagedllm.entrypoints.openai.limits import OPEN_ENDPOINTS

    client, _ = app_client
    documented = _docs_access_table()
    open_ = {path for path, is_open in documented.items() if is_open}
    assert open_ == set(OPEN_ENDPOINTS), documented
    routes = {path: next(iter(ops)).upper() for path, ops in client.app.openapi()["paths"].items()}
    routes.update({path: "GET" for path in documented if path not in routes})
    assert {"/tokenize", "/detokenize", "/score", "/rerank", "/v1/engine/state", "/openapi.json"} <= set(routes)
    assert open_ < set(routes)
    for path, method in routes.items():
        got = client.request(method, path.replace("{response_id}", "resp_x"), headers={"Authorization": ""})
        if path in open_:
            assert got.status_code != 401, path
        else:
            assert got.status_code == 401, (path, got.status_code)
            assert got.json()["error"]["type"] == "authentication_error"


def test_half_sent_requests_are_closed_while_normal_ones_are_served(model_dir):
    """Slowloris: 100 connections that send half a header and 100 that send half a body. Each is closed within
    the timeouts (the body's with a 408 first), and normal requests are answered meanwhile."""
    import socket

    from utils import Server

    server = Server(model_dir, "--request-header-timeout", "4", "--request-body-timeout", "4")
    host, port = server.url.removeprefix("http://").split(":")
    socks = []
    try:
        for i in range(200):
            s = socket.create_connection((host, int(port)), timeout=10)
            if i % 2:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Le")
            else:
                head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                s.sendall(head + b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "')
            socks.append(s)
        started = time.monotonic()
        with httpx.Client(timeout=60) as c:  # served while the 200 hang on
            r = c.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200, r.text
        answers = []
        for s in socks:  # each ends: the server closes it (EOF), after a 408 for a stalled body
            s.settimeout(max(1.0, 60 - (time.monotonic() - started)))
            got = b""
            while chunk := s.recv(65536):
                got += chunk
            answers.append(got)
        assert time.monotonic() - started < 60
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers[0::2]), answers[0][:200]
        assert all(a == b"" for a in answers[1::2]), answers[1][:200]
        with httpx.Client(timeout=60) as c:
            assert c.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    finally:
        for s in socks:
            s.close()
        server.stop()


def test_models_and_health_answer_503_until_the_model_is_loaded_and_never_model_loading_once_dead():
    """A client polling /v1/models must not start sending before the engine serves (it listed the model with a
    null max_model_len for the ~50 s of a first start); a start that failed is engine_dead, not model_loading."""
    import threading

    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.server import build_app

    go = threading.Event()

    def factory():
        go.wait(60)
        raise RuntimeError("no weights here")

    with TestClient(build_app(factory, MODEL)) as client:
        for path in ("/v1/models", "/health"):
            r = client.get(path)
            assert r.status_code == 503 and r.json()["error"]["type"] == "model_loading", (path, r.text)
        go.set()
        deadline = time.monotonic() + 60
        while client.get("/health").json()["error"]["type"] == "model_loading":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for path in ("/v1/models", "/health"):
            r = client.get(path)
            assert r.status_code == 503 and r.json()["error"]["type"] == "engine_dead", (path, r.text)


def test_schemathesis_with_every_check_finds_no_error_and_no_nonconformance(model_dir):
    """/openapi.json tells the truth: schemathesis (every check: status codes, content types, headers, response
    schemas, auth, negative data) against a keyed server finds no 5xx and nothing the schema does not document.
    ``positive_data_acceptance`` is left out: a schema cannot carry what depends on the model loaded (token ids
    within its vocabulary, prompts within its context, whether it pools), which the server rightly refuses."""
    import re

    from utils import Server, schemathesis

    server = Server(model_dir, "--api-key", KEY, "--max-model-len", "128")
    try:
        r = schemathesis(
            server.url,
            *("--checks", "all", "--exclude-checks", "positive_data_acceptance", "--max-examples", "15"),
            *("-H", f"Authorization: Bearer {KEY}"),
            *("--exclude-path-regex", "/stream$"),  # an endless stream: the dashboard test reads it
        )
        assert r.returncode == 0, r.stdout[-6000:]
        assert re.search(r"[1-9]\d* generated", r.stdout), r.stdout[-2000:]
        assert httpx.get(f"{server.url}/health").status_code == 200  # and it serves on
    finally:
        server.stop()


# -- property-based: any SamplingParams is refused with InvalidParameterError or served ----------------------------


def _sampling_kwargs():
    from hypothesis import strategies as st

    ints = st.sampled_from([0, 1, 2, -1, 49151, 49152, 2**31, 2**63 - 1, 2**63, 2**70, -(2**63) - 1])
    floats = st.sampled_from([0.0, 1e-300, 1e-3, 0.5, 1.0, 2.0, 1e4, 1e308, float("inf"), float("nan")]) | st.floats()
    ids = st.lists(ints, max_size=4)
    return st.fixed_dictionaries(
        {},
        optional={
            "temperature": floats,
            "top_p": floats,
            "top_k": ints,
            "min_p": floats,
            "presence_penalty": floats,
            "frequency_penalty": floats,
            "repetition_penalty": floats,
            "seed": ints,
            "n": st.sampled_from([1, 2, 3, 0, 2**70]),
            "min_tokens": st.sampled_from([0, 1, 3, 2**70]),
            "max_tokens": st.sampled_from([1, 4, 2**70, None]),
            "logprobs": st.sampled_from([None, 0, 2, 2**70]),
            "allowed_token_ids": st.none() | ids,
            "stop_token_ids": ids,
            "logit_bias": st.dictionaries(ints, floats, max_size=3),
            "bad_words": st.lists(st.sampled_from(["the", "a", "\ud800", ""]), max_size=2),
            "ignore_eos": st.booleans(),
        },
    )


def test_any_sampling_params_are_refused_or_served_and_the_engine_serves_on(llm, reference):
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(kwargs=_sampling_kwargs())
    def one(kwargs):
        try:
            params = SamplingParams(**kwargs)
        except InvalidParameterError:
            return
        params.max_tokens = min(params.max_tokens or 4, 4)
        params.min_tokens = min(params.min_tokens, params.max_tokens)
        try:
            outs = llm.generate(["Once upon a time"], params, use_tqdm=False)
        except InvalidParameterError:
            outs = None
        if outs is not None:
            for c in outs[0].outputs:  # served, or failed alone with the reason
                assert c.finish_reason in ("stop", "length", "error"), c
                assert all(0 <= t < 49152 for t in c.token_ids)
        check_engine_clean(llm)

    one()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference


@pytest.mark.parametrize("impl", ["h11", "httptools"])
def test_the_header_deadline_holds_with_either_http_parser(impl):
    """`pagedllm serve` from a plain install has uvicorn's h11 parser only (httptools comes with uvicorn[standard]):
    the header deadline works with both, on a fresh connection and on a kept-alive one after an answer."""
    import socket
    import threading

    import uvicorn

    from pagedllm.entrypoints.graceful_server import timed_http_protocol

    from utils import _free_port

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    port = _free_port()
    config = uvicorn.Config(app, port=port, http=timed_http_protocol(1.0, 100, impl), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)

        def ends_within(s: socket.socket, seconds: float) -> bytes:
            s.settimeout(seconds)
            got = b""
            while chunk := s.recv(4096):
                got += chunk
            return got

        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Half")
            assert ends_within(s, 10) == b""  # closed by the deadline, not by the test's timeout
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(0.3)
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Half")  # kept alive, then half a second request
            assert ends_within(s, 10).startswith(b"HTTP/1.1 200")
    finally:
        server.should_exit = True
        thread.join(30)
