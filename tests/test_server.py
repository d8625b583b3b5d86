"""The OpenAI-compatible server, driven over loopback with the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from utils import MODEL, TIME_TOOL, WEATHER_TOOL, Server, schemathesis

openai = pytest.importorskip("openai")

API_KEY = "sk-test-key"


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(
        model_dir,
        "--api-key",
        API_KEY,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--enable-prompt-tokens-details",
    )
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _headers():
    return {"Authorization": f"Bearer {API_KEY}"}


# -- happy paths ----------------------------------------------------------------------


def test_ready_line_is_logged_once_health_answers(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    deadline = time.time() + 10
    while "ready: serving" not in server.output() and time.time() < deadline:
        time.sleep(0.05)
    out = server.output()
    assert f"ready: serving {MODEL} at http://127.0.0.1:{server.port}/v1" in out, out[-2000:]
    assert out.index("engine ready in") < out.index("ready: serving")


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_streamed_text_equals_non_streamed(client):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert full.usage.completion_tokens == 20
    assert full.usage.total_tokens == full.usage.prompt_tokens + 20
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streamed_text_equals_non_streamed(client):
    msgs = [{"role": "user", "content": "Say something"}]
    full = client.chat.completions.create(
        model=MODEL, messages=msgs, max_completion_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=16, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content
    assert full.usage.completion_tokens == 16


def test_completion_matches_offline_generate(client, model_dir):
    from pagedllm import LLM, SamplingParams

    prompts = ["Hello there", "Once upon a time", "1 2 3 4"]
    llm = LLM(model=model_dir, max_model_len=256, num_gpu_blocks_override=128)
    offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    online = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in sorted(online.choices, key=lambda c: c.index)] == [o.outputs[0].text for o in offline]


def test_usage_counts_the_prompt_tokens_the_prefix_cache_supplied(client):
    """--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens, streamed and not, completions and
    chat; a prompt seen before has its full blocks cached (block size 16), a new one none."""
    prompt = "A prompt that no other test sends, long enough to fill a few blocks: " + "the cache " * 20
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 48 and first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    full_blocks = 16 * ((again.usage.prompt_tokens - 1) // 16)
    assert again.usage.prompt_tokens_details.cached_tokens == full_blocks
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, stream=True, stream_options={"include_usage": True}
        )
    )
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == full_blocks
    messages = [{"role": "user", "content": prompt}]
    chats = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2) for _ in range(2)]
    assert chats[0].usage.prompt_tokens_details.cached_tokens < chats[1].usage.prompt_tokens_details.cached_tokens
    assert chats[1].usage.prompt_tokens_details.cached_tokens == 16 * ((chats[1].usage.prompt_tokens - 1) // 16)


def test_logprobs_echo_stop_and_seed(client):
    out = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=5, temperature=0, logprobs=3, echo=True, extra_body={"ignore_eos": True}
    )
    c = out.choices[0]
    assert c.text.startswith("abc")
    assert len(c.logprobs.tokens) == 5 and all(len(t) == 3 for t in c.logprobs.top_logprobs)
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert len(chat.choices[0].logprobs.content) == 4
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)
    full = (
        client.completions.create(
            model=MODEL, prompt="xyz", max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = full[6:8]
    cut = client.completions.create(
        model=MODEL, prompt="xyz", max_tokens=20, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    ).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    a = client.completions.create(model=MODEL, prompt="seed", max_tokens=10, temperature=1.0, seed=7)
    b = client.completions.create(model=MODEL, prompt="seed", max_tokens=10, temperature=1.0, seed=7)
    assert a.choices[0].text == b.choices[0].text


def test_tokenize_detokenize_version_health(server):
    r = httpx.post(f"{server.url}/tokenize", headers=_headers(), json={"prompt": "Hello world"})
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 0
    d = httpx.post(f"{server.url}/detokenize", headers=_headers(), json={"tokens": r.json()["tokens"]})
    assert d.json()["prompt"] == "Hello world"
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_idle_connection_outlives_a_clients_pool_then_closes(server):
    """httpx (and so the official openai client) drops an idle connection from its pool after 5 s; the server keeps
    it open longer, so a request on a pooled connection never meets a server that is closing it (with both at
    5 s, one POST in a few thousand got a connection reset). Then, idle for --timeout-keep-alive, it closes."""
    import http.client

    from pagedllm.entrypoints.graceful_server import (
        CLIENT_KEEPALIVE_EXPIRY_S,
        HTTPX_KEEPALIVE_EXPIRY_S,
        SERVER_KEEP_ALIVE_S,
    )

    assert CLIENT_KEEPALIVE_EXPIRY_S < HTTPX_KEEPALIVE_EXPIRY_S and HTTPX_KEEPALIVE_EXPIRY_S + 3 <= SERVER_KEEP_ALIVE_S
    reused, idle = (http.client.HTTPConnection("127.0.0.1", server.port, timeout=60) for _ in range(2))
    for conn in (reused, idle):
        conn.request("GET", "/health")
        conn.getresponse().read()
    idle_since = time.monotonic()
    sock = reused.sock
    time.sleep(HTTPX_KEEPALIVE_EXPIRY_S + 0.5)  # idle a little longer than a client keeps it pooled
    reused.request("GET", "/health")
    r = reused.getresponse()
    r.read()
    assert r.status == 200 and reused.sock is sock  # answered on the same connection
    idle.sock.settimeout(SERVER_KEEP_ALIVE_S + 60)
    assert idle.sock.recv(1) == b""  # the other one the server closes (--timeout-keep-alive), never sooner
    assert time.monotonic() - idle_since >= SERVER_KEEP_ALIVE_S - 0.5
    reused.close()
    idle.close()


def test_64_concurrent_streams_all_complete_and_match_offline(server, model_dir):
    from pagedllm import LLM, SamplingParams

    prompts = [f"Request number {i}: tell me about {i * 7}" for i in range(64)]

    async def one(aclient, p):
        stream = await aclient.completions.create(
            model=MODEL, prompt=p, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
        return await asyncio.gather(*(one(aclient, p) for p in prompts))

    texts = asyncio.run(main())
    llm = LLM(model=model_dir, max_model_len=256, num_gpu_blocks_override=128)
    offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert texts == [o.outputs[0].text for o in offline]


def test_client_disconnect_aborts_and_frees_kv_blocks(server):
    before = _generated_tokens(server.url)
    with (
        httpx.Client(timeout=30) as h,
        h.stream(
            "POST",
            f"{server.url}/v1/completions",
            headers=_headers(),
            json={"model": MODEL, "prompt": "a long story", "max_tokens": 200, "stream": True, "ignore_eos": True},
        ) as r,
    ):
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        assert server.metric("pagedllm:num_requests_running") >= 0
    t0 = time.time()
    while time.time() - t0 < 10:
        if server.metric("pagedllm:num_requests_running") == 0 and server.metric("pagedllm:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.1)
    assert server.metric("pagedllm:kv_cache_usage_perc") == 0
    # aborted when the client left, not run to its end: fewer than its 200 tokens were generated (an order of
    # events, whatever this machine's speed; the 10 s above are only a liveness limit)
    assert _generated_tokens(server.url) - before < 200
    text = httpx.get(f"{server.url}/metrics").text
    assert re.search(r'pagedllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} [1-9]', text)


def test_a_client_that_leaves_a_whole_answer_is_aborted_quietly(server):
    """A non-streaming request whose client goes away: aborted at the server's next half-second check (counted as
    an abort), its KV blocks freed, and one log line for it, not an 'Exception in ASGI application' traceback (any
    client can cause it: it is no server error)."""
    seen, aborted = len(server.output()), _aborted(server.url)
    # 64 sequences of 200 tokens, six times what the server's 2,048 tokens of KV cache hold at once: seconds of work
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 200, "ignore_eos": True, "n": 64}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", headers=_headers(), json=body, timeout=0.3)
    t0 = time.time()
    while time.time() - t0 < 10 and "the client went away" not in server.output()[seen:]:
        time.sleep(0.1)
    while time.time() - t0 < 10 and server.metric("pagedllm:kv_cache_usage_perc") > 0:
        time.sleep(0.1)
    log = server.output()[seen:]
    assert "POST /v1/completions: the client went away; its request was aborted" in log
    assert "Traceback" not in log and "Exception in ASGI application" not in log
    assert server.metric("pagedllm:kv_cache_usage_perc") == 0
    assert _aborted(server.url) > aborted


def _aborted(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    pattern = r'^pagedllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


# -- errors ------------------------------------------------------------------------------


def _err(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    assert body["error"]["code"] == status
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": 50}, "logprobs"),
        ({"bogus_field": 1}, "bogus_field"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [10**9]}, "prompt_token_ids"),
    ],
)
def test_invalid_parameters_get_400_in_openai_shape(server, body, param):
    r = httpx.post(f"{server.url}/v1/completions", headers=_headers(), json={"model": MODEL, "prompt": "hi", **body})
    err = _err(r, 400)
    assert param in (err["param"] or "") or param in err["message"]


def test_an_image_to_a_text_only_model_is_400(server):
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=_headers(), json={"model": MODEL, "messages": messages})
    assert "image_url" in _err(r, 400, "messages")["message"]


def test_prompt_over_context_says_both_numbers(server):
    r = httpx.post(
        f"{server.url}/v1/completions", headers=_headers(), json={"model": MODEL, "prompt": [5] * 300, "max_tokens": 4}
    )
    assert re.search(r"300.*256", _err(r, 400)["message"])


def test_max_tokens_beyond_the_context_is_400_not_cut(server, client):
    """OpenAI's and vLLM's rule: prompt + max_tokens must fit max_model_len (256 here); offline cuts instead."""
    for path, extra in (
        ("completions", {"prompt": [5] * 250}),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi " * 150}]}),
    ):
        r = httpx.post(
            f"{server.url}/v1/{path}",
            headers=_headers(),
            json={"model": MODEL, "max_tokens": 1000, "stream": True, **extra},
        )
        err = _err(r, 400, "max_tokens")
        assert re.search(r"1000.*256", err["message"]), err
    fits = client.completions.create(
        model=MODEL, prompt=[5] * 250, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert fits.usage.completion_tokens == 6 and fits.choices[0].finish_reason == "length"
    assert _err(
        httpx.post(
            f"{server.url}/v1/completions",
            headers=_headers(),
            json={"model": MODEL, "prompt": [5] * 250, "max_tokens": 7},
        ),
        400,
        "max_tokens",
    )


def test_malformed_json_is_400(server):
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers={**_headers(), "Content-Type": "application/json"},
        content=b"{not json",
    )
    _err(r, 400)


def test_api_key_required_on_every_working_endpoint_but_not_probes(server):
    _err(httpx.get(f"{server.url}/v1/models"), 401)
    _err(httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    _err(httpx.post(f"{server.url}/tokenize", json={"prompt": "hi"}), 401)
    _err(httpx.post(f"{server.url}/detokenize", json={"tokens": [1]}), 401)
    _err(httpx.get(f"{server.url}/openapi.json"), 401)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert httpx.get(f"{server.url}/version").status_code == 200


def test_unknown_model_is_404(server):
    r = httpx.post(f"{server.url}/v1/completions", headers=_headers(), json={"model": "gpt-9", "prompt": "hi"})
    assert "gpt-9" in _err(r, 404)["message"]


def test_oversized_body_is_413(server):
    r = httpx.post(
        f"{server.url}/v1/completions", headers=_headers(), json={"model": MODEL, "prompt": "x" * (17 << 20)}
    )
    _err(r, 413)


def test_bad_requests_do_not_disturb_others(server, client):
    ok = (
        client.completions.create(
            model=MODEL, prompt="steady", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    for body in ({"temperature": -1}, {"prompt": [5] * 300}, {"stop_token_ids": [10**9]}):
        httpx.post(f"{server.url}/v1/completions", headers=_headers(), json={"model": MODEL, "prompt": "hi", **body})
    again = (
        client.completions.create(
            model=MODEL, prompt="steady", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    assert again == ok


def test_full_queue_gets_503_with_retry_after(model_dir):
    s = Server(model_dir, "--max-queue-len", "0")
    try:
        r = httpx.post(f"{s.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        _err(r, 503)
        assert r.headers.get("retry-after")
    finally:
        s.stop()


def test_sigterm_finishes_in_flight_requests_and_exits_0(model_dir):
    s = Server(model_dir)
    with (
        httpx.Client(timeout=60) as h,
        h.stream(
            "POST",
            f"{s.url}/v1/completions",
            json={"model": MODEL, "prompt": "go", "max_tokens": 60, "stream": True, "ignore_eos": True},
        ) as r,
    ):
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        s.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(x[5:]) for x in [first] + rest[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert s.proc.wait(30) == 0


@pytest.mark.slow
def test_schemathesis_finds_no_server_errors(server):
    """Fuzz every operation of the server's own OpenAPI schema; any 5xx fails. (The Responses API's are fuzzed in
    test_responses_api, where a hook keeps their answers short: most of its fuzzed bodies are valid and would each
    generate up to the context's end.)"""
    r = schemathesis(
        server.url,
        *("--checks", "not_a_server_error", "--max-examples", "20", "--exclude-path-regex", "^/v1/responses"),
        *("-H", f"Authorization: Bearer {API_KEY}"),
    )
    assert r.returncode == 0, r.stdout[-4000:]
    assert re.search(r"[1-9]\d* generated, [1-9]\d* passed", r.stdout), r.stdout[-2000:]


def _generated_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(v) for v in re.findall(r"^pagedllm:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M))


def test_bench_serve_reports_vllm_metrics(server, tmp_path):
    out = tmp_path / "bench.json"
    before = _generated_tokens(server.url)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--api-key",
            API_KEY,
            "--num-prompts",
            "6",
            "--random-input-len",
            "40",
            "--random-output-len",
            "5",
            "--max-concurrency",
            "3",
            "--request-rate",
            "50",
            "--num-warmups",
            "2",
            "--goodput",
            "ttft:100000",
            "--result-file",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert report["completed"] == 6 and report["failed"] == 0 and report["num_warmups"] == 2
    # the two warm-up requests reached the server, and only the six timed ones are in the report (the metrics
    # are counted after a step's outputs are sent, so the last step may land a moment after the client is done)
    deadline = time.monotonic() + 10
    while _generated_tokens(server.url) - before < 8 * 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _generated_tokens(server.url) - before == 8 * 5
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--num-warmups",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "--num-warmups must be 0 or more" in bad.stderr
    assert report["total_output_tokens"] == 30
    for key in (
        "mean_ttft_ms",
        "median_tpot_ms",
        "p99_itl_ms",
        "mean_e2el_ms",
        "request_throughput",
        "output_throughput",
        "request_goodput",
    ):
        assert report[key] > 0, key
    assert report["model"] == MODEL


def test_grafana_dashboard_uses_only_exported_metrics(server):
    dash = json.loads(
        (Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "pagedllm-dashboard.json").read_text()
    )
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"pagedllm:[a-z0-9_]+", e)}
    exported = set(re.findall(r"^(pagedllm:[a-z0-9_]+)", httpx.get(f"{server.url}/metrics").text, re.M))
    assert used and used <= exported, used - exported


def test_n_completions_streamed_and_not(client):
    kw = dict(
        model=MODEL,
        prompt=["first prompt", "second"],
        max_tokens=8,
        temperature=1.0,
        n=3,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kw)
    assert sorted(c.index for c in full.choices) == list(range(6))
    assert full.usage.completion_tokens == 6 * 8
    by_index = {c.index: c.text for c in full.choices}
    assert len(set(by_index.values())) > 1
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == by_index
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in chat.choices] == [0, 1]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {c.index: c.message.content for c in chat.choices}


def test_logit_bias_and_allowed_tokens_over_http(client):
    tok_resp = httpx.post(
        f"{client.base_url.scheme}://{client.base_url.host}:{client.base_url.port}/tokenize",
        json={"prompt": " banana", "add_special_tokens": False},
        headers=_headers(),
    ).json()
    target = tok_resp["tokens"][0]
    out = client.completions.create(
        model=MODEL,
        prompt="Fruit:",
        max_tokens=3,
        temperature=0,
        logit_bias={str(target): 100},
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == " banana" * 3
    only = client.completions.create(
        model=MODEL,
        prompt="Fruit:",
        max_tokens=4,
        temperature=1.0,
        seed=1,
        extra_body={"ignore_eos": True, "allowed_token_ids": [target]},
    )
    assert only.choices[0].text == " banana" * 4
    r = httpx.post(
        f"{client.base_url.scheme}://{client.base_url.host}:{client.base_url.port}/v1/completions",
        headers=_headers(),
        json={"model": MODEL, "prompt": "x", "logit_bias": {"999999999": 5}},
    )
    _err(r, 400, "logit_bias")


def test_structured_outputs_over_http(client, server):
    """response_format json_schema / json_object and extra_body structured_outputs, streamed and not."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["name", "n"],
    }
    msgs = [{"role": "user", "content": "A user as JSON"}]
    rf = {"type": "json_schema", "json_schema": {"name": "user", "schema": schema}}
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=80, temperature=0, response_format=rf)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    stream = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=80, temperature=0, response_format=rf, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=80, temperature=0.9, seed=31, response_format={"type": "json_object"}
    )
    # seed 31: one of the few draws where this random model opens a key rather than closing the object at once
    text = r.choices[0].message.content  # a random model's free-form object may not close within max_tokens
    assert text.startswith('{"') and (r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))
    r = client.completions.create(
        model=MODEL,
        prompt="Label:",
        max_tokens=8,
        temperature=1.0,
        seed=2,
        n=3,
        extra_body={"structured_outputs": {"choice": ["spam", "ham"]}},
    )
    assert {c.text for c in r.choices} <= {"spam", "ham"}
    assert server.metric("pagedllm:structured_output_requests_total") >= 4
    assert server.metric("pagedllm:grammar_compile_seconds_count") >= 3  # three specs, compiled cold once each
    assert server.metric("pagedllm:grammar_compile_cache_hits_total") >= 1  # the streamed repeat
    for body, param in [
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "response_format.json_schema"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ]:
        resp = httpx.post(
            f"{server.url}/v1/completions", headers=_headers(), json={"model": MODEL, "prompt": "hi", **body}
        )
        assert _err(resp, 400)["param"] == param


def _check_call(call, tools=(WEATHER_TOOL, TIME_TOOL)):
    import jsonschema

    tool = next(t for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.id and call.type == "function"


def test_named_and_required_tool_calls_validate(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            tools=[WEATHER_TOOL, TIME_TOOL],
            tool_choice=named,
            max_tokens=120,
            temperature=1.0,
            seed=seed,
        )
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and r.choices[0].finish_reason == "stop"
        _check_call(call)
        r = client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            tools=[WEATHER_TOOL, TIME_TOOL],
            tool_choice="required",
            max_tokens=200,
            temperature=1.0,
            seed=seed,
        )
        calls = r.choices[0].message.tool_calls
        assert calls and r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        for call in calls:
            _check_call(call)
    # streamed: the named call's arguments arrive as deltas and add up to the non-streamed answer
    kw = dict(
        model=MODEL, messages=msgs, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=named, max_tokens=120, temperature=0
    )
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    deltas = [
        c.choices[0].delta.tool_calls[0]
        for c in client.chat.completions.create(**kw, stream=True)
        if c.choices and c.choices[0].delta.tool_calls
    ]
    assert len(deltas) > 1 and deltas[0].id and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    # required: each call of the array streams as it is written, its id and name once, then its arguments in
    # pieces; the openai client's stream helper accumulates them to the non-streamed answer's calls
    kw["tool_choice"] = "required"
    whole = client.chat.completions.create(**kw).choices[0]
    with client.chat.completions.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    assert whole.finish_reason == final.finish_reason == "tool_calls" and not final.message.content
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    pieces = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    for i, call in enumerate(whole.message.tool_calls):
        assert len([e for e in pieces if e.index == i]) > 1, (i, call)  # over several chunks
        assert len({c.id for c in final.message.tool_calls}) == len(whole.message.tool_calls)


# a weather call as the model's own text (forced by a regex, as a tiny random model would not write one)
WEATHER_CALL_RX = r'\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", "unit": "c"\}\}'


def _answer_forced(rx: str) -> dict:
    """A chat request under tool_choice auto whose answer the regex ``rx`` writes."""
    return dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        max_tokens=80,
        temperature=0,
        extra_body={"structured_outputs": {"regex": rx}},
    )


def test_auto_tool_choice_with_the_hermes_parser(client):
    """The model's own text carries a hermes tool call (here forced by a regex, as a tiny random model would
    not write one): the parser lifts it into tool_calls, streamed and not."""
    kw = _answer_forced(f"<tool_call>{WEATHER_CALL_RX}</tool_call>")
    r = client.chat.completions.create(**kw)  # tool_choice defaults to auto when tools are given
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather"
    _check_call(call)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    # as vLLM's hermes parser streams: the id and name once, then the arguments in pieces as they are written
    first, rest = streamed[0], streamed[1:]
    assert first.id and first.type == "function" and first.function.name == "get_weather" and len(rest) > 3
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert "".join(d.function.arguments or "" for d in streamed) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # a plain answer stays content
    r = client.chat.completions.create(
        model=MODEL, messages=kw["messages"], tools=[WEATHER_TOOL], max_tokens=8, temperature=0
    )
    assert r.choices[0].message.tool_calls == [] and r.choices[0].message.content


@pytest.mark.parametrize("fence", ["", "```json\n"])
def test_auto_streams_an_untagged_call_in_pieces_as_the_openai_stream_helper_sees_it(client, fence):
    """The untagged form small Qwen models write (the call as bare JSON, or in a ```json fence) streams as it is
    written, like a tagged call: the openai client's stream helper gets the arguments over several chunks and
    accumulates them to the non-streamed answer's call."""
    kw = _answer_forced(f"{re.escape(fence)}{WEATHER_CALL_RX}" + (r"\n```" if fence else ""))
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (expected,) = whole.message.tool_calls
    _check_call(expected)
    with client.chat.completions.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and not final.message.content
    (got,) = final.message.tool_calls
    assert (got.function.name, got.function.arguments) == (expected.function.name, expected.function.arguments)
    pieces = [e.arguments_delta for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(pieces) > 3 and "".join(pieces) == expected.function.arguments
    assert not [e for e in events if e.type == "content.delta" and e.delta]  # nothing of it leaks out as text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice"),
        ({"structured_outputs": {"json": "false"}}, "structured_outputs.json"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"tools": [WEATHER_TOOL] * 200, "tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        (  # not a JSON Schema: refused for every tool_choice, naming the tool
            {"tools": [WEATHER_TOOL, {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
            "tools[1].function.parameters",
        ),
    ],
)
def test_bad_tool_requests_get_400(server, body, param):
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers=_headers(),
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body},
    )
    assert param in (_err(r, 400)["param"] or "")


def test_engine_state_snapshot(server, client):
    """GET /v1/engine/state: the block map and queues, taken on the engine thread between steps."""
    r = httpx.get(f"{server.url}/v1/engine/state")
    assert r.status_code == 401  # behind the API key, as the rest of /v1
    idle = httpx.get(f"{server.url}/v1/engine/state", headers=_headers()).json()
    assert idle["num_blocks"] == len(idle["block_map"]) == sum(idle["blocks"].values())
    assert idle["blocks"]["used"] == idle["blocks"]["shared"] == 0 and idle["running"] == []
    stream = client.completions.create(
        model=MODEL,
        prompt="Once upon a time " * 20,
        max_tokens=150,
        temperature=0,
        stream=True,
        n=2,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))  # running now
    busy = httpx.get(f"{server.url}/v1/engine/state", headers=_headers()).json()
    stream.close()
    assert busy["num_running"] >= 1 and busy["running"][0]["prompt_tokens"] > 40
    assert busy["blocks"]["used"] + busy["blocks"]["shared"] > 0  # the prompt's blocks (shared by the n=2 pair)
    assert busy["steps"] and busy["steps"][-1]["decode_tokens"] + busy["steps"][-1]["prefill_tokens"] > 0
    for _ in range(50):  # the aborted stream frees its blocks
        after = httpx.get(f"{server.url}/v1/engine/state", headers=_headers()).json()
        if after["blocks"]["used"] + after["blocks"]["shared"] == 0:
            break
        time.sleep(0.1)
    assert after["blocks"]["used"] + after["blocks"]["shared"] == 0 and after["num_running"] == 0


def test_trace_file_is_a_chrome_trace_of_steps_and_requests(model_dir, tmp_path):
    path = tmp_path / "trace.json"
    s = Server(model_dir, "--trace-file", str(path))
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
        c.completions.create(model=MODEL, prompt="Hello there", max_tokens=8, temperature=0)
        c.completions.create(model=MODEL, prompt="A river town", max_tokens=6, temperature=0.5, seed=1, n=2)
        list(
            c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True
            )
        )
    finally:
        assert s.stop() == 0
    events = json.loads(path.read_text())  # closed at shutdown: strict JSON
    steps = [e for e in events if e.get("name") == "step"]
    assert steps and all(
        e["ph"] == "X" and e["dur"] >= 0 and e["args"]["decode_tokens"] + e["args"]["prefill_tokens"] for e in steps
    )
    begins = {e["id"] for e in events if e.get("cat") == "request" and e["ph"] == "b"}
    ends = {e["id"]: e for e in events if e.get("cat") == "request" and e["ph"] == "e"}
    firsts = {e["id"] for e in events if e.get("name") == "first token"}
    assert len(begins) == 3 and begins == set(ends) == firsts  # one slice per request (n=2 is one request)
    assert sorted(len(e["args"]["finish_reason"]) for e in ends.values()) == [1, 1, 2]
    assert all(e["args"]["output_tokens"] > 0 for e in ends.values())
    for rid in begins:  # each request's slice starts before its first token and ends after it
        b = next(e["ts"] for e in events if e.get("id") == rid and e["ph"] == "b")
        f = next(e["ts"] for e in events if e.get("id") == rid and e.get("name") == "first token")
        assert b <= f <= ends[rid]["ts"]
