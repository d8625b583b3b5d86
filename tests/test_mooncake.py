"""Disaggregated prefill / decode over Mooncake's Transfer Engine: `pagedllm disagg-proxy` in front of a producer
server and a consumer server that share nothing but a TCP connection. The consumer reads each prompt's KV blocks
out of the producer's cache, computes one token of the prompt, and answers what one server answers alone; faults
(a read that fails, a producer gone, a hold that timed out, a consumer that never came) cost a recompute, never a
wrong answer or a leaked block."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest
from test_disagg import Proxy

from pagedllm import LLM
from pagedllm.errors import InvalidParameterError

from utils import MODEL, Server

pytest.importorskip(
    "mooncake.engine",
    reason="Mooncake's Transfer Engine is not importable (pip install mooncake-transfer-engine-non-cuda; "
    "apt-get install libibverbs1)",
)

HOLD_S = 4  # the producer's hold timeout in these tests

SHARED = "You are a careful assistant. " + " ".join(f"rule{i}" for i in range(40)) + ". "
PROMPTS = [
    SHARED + "Question one: what is word7?",
    SHARED + "Question two: list the rules backwards.",
    "A long prompt: " + " ".join(f"w{(i * 13) % 101}" for i in range(60)),
    "Short.",
]


def _config(**extra) -> dict:
    return {"kv_connector": "MooncakeConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(kv_transfer_config=_config(protocol="udp")), "kv_transfer_config.kv_connector_extra_config.protocol"),
        (
            dict(kv_transfer_config=_config(hold_timeout_s=0)),
            "kv_transfer_config.kv_connector_extra_config.hold_timeout_s",
        ),
        (
            dict(kv_transfer_config=_config(side_channel_port=70000)),
            "kv_transfer_config.kv_connector_extra_config.side_channel_port",
        ),
        (dict(kv_transfer_config=_config(host="")), "kv_transfer_config.kv_connector_extra_config.host"),
        (dict(kv_transfer_config=_config(path="/tmp")), "kv_transfer_config.kv_connector_extra_config.path"),
        (dict(kv_transfer_config=_config(), tensor_parallel_size=2), "tensor_parallel_size"),
        (dict(kv_transfer_config=_config(), pipeline_parallel_size=2), "pipeline_parallel_size"),
        (dict(kv_transfer_config=_config(), kv_offloading_size=1), "kv_offloading_size"),
        (
            dict(
                kv_transfer_config=_config(),
                speculative_config={"method": "draft_model", "model": "unused", "num_speculative_tokens": 2},
            ),
            "kv_transfer_config",
        ),
    ],
)
def test_settings_the_connector_cannot_run_are_refused_before_loading(kwargs, param):
    with pytest.raises(InvalidParameterError) as e:
        LLM(model="unused", **kwargs)
    assert e.value.param == param, e.value


def _mooncake(role: str, hold: float = HOLD_S, host: str = "127.0.0.1") -> str:
    return json.dumps(
        {
            "kv_connector": "MooncakeConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"host": host, "hold_timeout_s": hold},
        }
    )


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def pair(model):
    producer = Server(model, "--kv-transfer-config", _mooncake("kv_producer"))
    try:
        consumer = Server(model, "--kv-transfer-config", _mooncake("kv_consumer"))
    except BaseException:
        producer.stop()
        raise
    yield producer, consumer
    for s in (producer, consumer):
        s.stop()


@pytest.fixture(scope="module")
def alone(model):
    """One server, no connector: what the pair must answer."""
    server = Server(model)
    yield server
    server.stop()


def _body(prompt: str, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **kw}


def _texts(url: str, body: dict) -> list[str]:
    """The choices' texts, streamed or not."""
    if not body.get("stream"):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    texts: dict[int, str] = {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return [texts[i] for i in sorted(texts)]


def _chat(url: str, content: str) -> dict:
    """A greedy chat answer's message."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 10, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def _prefill(producer: Server, prompt: str) -> dict:
    """What a producer answers the proxy: the prompt computed, its blocks held, where they are."""
    r = httpx.post(
        f"{producer.url}/v1/completions",
        json=_body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
        timeout=60,
    )
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"], params
    return params


def _metric(server: Server, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _clean(server: Server, timeout: float = 10.0) -> None:
    """Nothing running, no block held by anyone (a producer frees released holds within half a second), and
    the block pool's invariants hold."""
    deadline = time.time() + timeout
    while True:
        state = httpx.get(f"{server.url}/v1/engine/state", params={"check": "true"}, timeout=10).json()
        used = state["blocks"]["used"] + state["blocks"]["shared"]
        if state["invariants"] == "ok" and used == 0 and not state["running"]:
            return
        assert time.time() < deadline, (state["invariants"], state["blocks"], state["running"])
        time.sleep(0.25)


def test_the_pair_answers_what_one_server_answers_computing_one_token_per_prompt(pair, alone):
    producer, consumer = pair
    proxy = Proxy(producer.url, consumer.url)
    try:
        workload = [
            _body(PROMPTS[0]),
            _body(PROMPTS[1], stream=True),
            _body(PROMPTS[2], max_tokens=20),
            _body(PROMPTS[3]),
            _body(PROMPTS[0], n=2, temperature=0.8, seed=7),  # n > 1, seeded: each choice follows its seed
            _body(PROMPTS[1], n=2, temperature=0.8, seed=3, stream=True),
        ]
        before = {
            k: _metric(consumer, f"pagedllm:{k}_total")
            for k in ("prompt_tokens", "kv_transfer_pulls", "kv_transfer_failures")
        }
        got = [_texts(proxy.url, b) for b in workload]
        chat = _chat(proxy.url, PROMPTS[0])
        after = {k: _metric(consumer, f"pagedllm:{k}_total") for k in before}
        # the consumer computed one token of each prompt (the last: its logits sample the first output token)
        assert after["prompt_tokens"] - before["prompt_tokens"] == len(workload) + 1
        assert after["kv_transfer_pulls"] - before["kv_transfer_pulls"] == len(workload) + 1
        assert after["kv_transfer_failures"] == before["kv_transfer_failures"]
        assert _metric(consumer, "pagedllm:kv_transfer_bytes_total", direction="pull") > 0
        assert got == [_texts(alone.url, {**b, "stream": False}) for b in workload]
        assert chat == _chat(alone.url, PROMPTS[0])
        # every hold was released by the consumer, none timed out
        _clean(producer)
        _clean(consumer)
        assert _metric(producer, "pagedllm:kv_transfer_pending") == 0
        assert _metric(producer, "pagedllm:kv_transfer_hold_timeouts_total") == 0
        assert _metric(producer, "pagedllm:kv_transfer_bytes_total", direction="serve") > 0
    finally:
        proxy.stop()


def _decode(consumer: Server, prompt: str, params: dict) -> list[str]:
    return _texts(consumer.url, _body(prompt, kv_transfer_params=params))


def test_a_read_that_fails_is_recomputed(pair, alone):
    producer, consumer = pair
    failures = _metric(consumer, "pagedllm:kv_transfer_failures_total")
    params = _prefill(producer, PROMPTS[2])
    expected = _texts(alone.url, _body(PROMPTS[2]))
    bad = {**params, "remote_base": 8}  # an address the producer never registered: its engine refuses the read
    assert _decode(consumer, PROMPTS[2], bad) == expected
    assert _metric(consumer, "pagedllm:kv_transfer_failures_total") == failures + 1
    # other blocks of the producer's (another request's, say): the read works, but the producer releases a hold
    # only to whoever read the blocks it holds, so the consumer learns the read is not the prompt's
    elsewhere = {
        **params,
        "remote_block_ids": [(b + 1) % params["remote_num_blocks"] for b in params["remote_block_ids"]],
    }
    assert _decode(consumer, PROMPTS[2], elsewhere) == expected
    assert _metric(consumer, "pagedllm:kv_transfer_failures_total") == failures + 2
    assert _metric(producer, "pagedllm:kv_transfer_pending") == 1  # still held for the rightful consumer
    assert _decode(consumer, PROMPTS[2], params) == expected
    assert _metric(consumer, "pagedllm:kv_transfer_failures_total") == failures + 2
    _clean(producer)
    _clean(consumer)


def test_a_hold_that_timed_out_is_neither_read_nor_leaked(pair, alone):
    producer, consumer = pair
    timeouts = _metric(producer, "pagedllm:kv_transfer_hold_timeouts_total")
    failures = _metric(consumer, "pagedllm:kv_transfer_failures_total")
    params = _prefill(producer, PROMPTS[1])
    _clean(producer, timeout=HOLD_S + 5)  # freed by the timeout, on an idle engine
    assert _metric(producer, "pagedllm:kv_transfer_hold_timeouts_total") == timeouts + 1
    # the blocks may hold another prompt's KV by now: the producer's release answer says so, the consumer recomputes
    httpx.post(f"{producer.url}/v1/completions", json=_body(PROMPTS[3] * 20), timeout=60)
    assert _decode(consumer, PROMPTS[1], params) == _texts(alone.url, _body(PROMPTS[1]))
    assert _metric(consumer, "pagedllm:kv_transfer_failures_total") == failures + 1
    _clean(consumer)


def test_a_producer_that_died_costs_the_consumer_a_recompute(model, pair, alone):
    _, consumer = pair
    failures = _metric(consumer, "pagedllm:kv_transfer_failures_total")
    doomed = Server(model, "--kv-transfer-config", _mooncake("kv_producer"))
    try:
        params = _prefill(doomed, PROMPTS[0])
    finally:
        doomed.proc.send_signal(signal.SIGKILL)
        doomed.proc.wait(30)
    assert _decode(consumer, PROMPTS[0], params) == _texts(alone.url, _body(PROMPTS[0]))
    assert _metric(consumer, "pagedllm:kv_transfer_failures_total") == failures + 1
    _clean(consumer)


def test_a_consumer_that_died_mid_answer_leaks_nothing_on_either_side(model, pair, alone):
    producer, _ = pair
    doomed = Server(model, "--kv-transfer-config", _mooncake("kv_consumer"))
    try:
        params = _prefill(producer, PROMPTS[0])
        body = _body(PROMPTS[0], max_tokens=100, stream=True, kv_transfer_params=params)
        with httpx.stream("POST", f"{doomed.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):  # it pulled the blocks and is streaming
                    doomed.proc.send_signal(signal.SIGKILL)
                    break
        assert doomed.proc.wait(30) == -signal.SIGKILL
    finally:
        doomed.stop()
    _clean(producer)  # released at the pull, before the first token
    assert _metric(producer, "pagedllm:kv_transfer_pending") == 0


def test_kv_transfer_params_that_cannot_be_used_here_are_a_400_naming_the_field(pair, alone):
    producer, consumer = pair
    params = _prefill(producer, PROMPTS[3])
    cases = [
        (alone, {"do_remote_decode": True}, "kv_transfer_params"),  # no connector
        (producer, params, "kv_transfer_params.do_remote_prefill"),  # a producer does not decode
        (consumer, {"do_remote_decode": True}, "kv_transfer_params.do_remote_decode"),
        (consumer, {**params, "remote_layout": {**params["remote_layout"], "block_size": 32}}, "remote_layout"),
        (consumer, {**params, "remote_port": "x"}, "kv_transfer_params.remote_port"),
        (consumer, {**params, "surprise": 1}, "kv_transfer_params.surprise"),
        (consumer, [1], "kv_transfer_params"),
        (consumer, {**params, "remote_base": -1}, "kv_transfer_params.remote_base"),
        (consumer, {**params, "remote_base": 1 << 64}, "kv_transfer_params.remote_base"),
        (consumer, {**params, "remote_side_channel_port": 1 << 63}, "kv_transfer_params.remote_side_channel_port"),
        (consumer, {**params, "remote_port": 0}, "kv_transfer_params.remote_port"),
        (
            consumer,
            {**params, "remote_block_ids": params["remote_block_ids"][:-1]},
            "kv_transfer_params.remote_block_ids",
        ),
        (
            consumer,
            {**params, "remote_block_ids": [params["remote_num_blocks"]] * len(params["remote_block_ids"])},
            "kv_transfer_params.remote_block_ids",
        ),
        (consumer, {**params, "remote_num_blocks": 0}, "kv_transfer_params.remote_num_blocks"),
        (consumer, {**params, "remote_host": "h" * 300}, "kv_transfer_params.remote_host"),
    ]
    for server, bad, field in cases:
        r = httpx.post(f"{server.url}/v1/completions", json=_body(PROMPTS[3], kv_transfer_params=bad), timeout=60)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"].endswith(field.rsplit(".", 1)[-1]), r.json()
    r = httpx.post(
        f"{consumer.url}/v1/completions",
        json=_body(["a", "b"], kv_transfer_params={"do_remote_decode": True}),
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    r = httpx.post(
        f"{producer.url}/v1/completions",
        json=_body(PROMPTS[3], stream=True, kv_transfer_params={"do_remote_decode": True}),
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params.do_remote_decode", r.text
    assert _decode(consumer, PROMPTS[3], params)  # the real params still serve
    _clean(producer)


@pytest.fixture
def netns():
    """A network namespace joined to this one by a veth pair: (its name, its address, this side's address)."""
    ns, pid = f"pgmc{os.getpid()}", os.getpid()
    subnet = f"10.231.{pid % 250}"
    here, there = f"pgv{pid % 100000}a", f"pgv{pid % 100000}b"

    def ip(*args: str) -> None:
        r = subprocess.run(["ip", *args], capture_output=True, text=True)
        assert r.returncode == 0, (args, r.stderr)

    try:
        made = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no `ip` command (iproute2) on this machine")
    if made.returncode:
        pytest.skip(f"cannot create a network namespace here (needs root): {made.stderr.strip()}")
    try:
        ip("link", "add", here, "type", "veth", "peer", "name", there, "netns", ns)
        ip("addr", "add", f"{subnet}.2/24", "dev", here)
        ip("link", "set", here, "up")
        ip("netns", "exec", ns, "ip", "addr", "add", f"{subnet}.1/24", "dev", there)
        ip("netns", "exec", ns, "ip", "link", "set", there, "up")
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, f"{subnet}.1", f"{subnet}.2"
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_the_pair_across_two_network_namespaces(model, alone, netns):
    """The producer in a namespace of its own, reached over a veth pair: the transfer crosses a network
    interface, not loopback."""
    ns, there, here = netns
    producer = Server(
        model,
        "--kv-transfer-config",
        _mooncake("kv_producer", host=there),
        host=there,
        prefix=("ip", "netns", "exec", ns),
    )
    consumer = None
    try:
        consumer = Server(model, "--kv-transfer-config", _mooncake("kv_consumer", host=here))
        proxy = Proxy(producer.url, consumer.url)
        try:
            workload = [
                _body(PROMPTS[0]),
                _body(PROMPTS[2], stream=True),
                _body(PROMPTS[1], n=2, temperature=0.8, seed=1),
            ]
            assert [_texts(proxy.url, b) for b in workload] == [
                _texts(alone.url, {**b, "stream": False}) for b in workload
            ]
            assert _metric(consumer, "pagedllm:kv_transfer_pulls_total") == len(workload)
            assert _metric(consumer, "pagedllm:prompt_tokens_total") == len(workload)
            assert _metric(consumer, "pagedllm:kv_transfer_failures_total") == 0
            _clean(producer)
            _clean(consumer)
        finally:
            proxy.stop()
    finally:
        producer.stop()
        if consumer is not None:
            consumer.stop()


def test_a_pull_of_scattered_blocks_reads_every_byte_and_releases_the_hold():
    """The worker half on its own: a producer's cache and a consumer's in one process, 40 blocks scattered over
    both (40 runs x 48 layers x K and V: 3,840 ranges, more than one batched read may hold)."""
    import random
    import threading

    import torch

    from pagedllm.kv_transfer.config import MooncakeOptions
    from pagedllm.kv_transfer.metadata import KVConnectorMetadata, RemotePull
    from pagedllm.kv_transfer.mooncake import MooncakeWorker, _Holds, _SideChannel, where_digest
    from pagedllm.worker.kv_cache import allocate_kv_caches

    layers, blocks = 48, 96
    make = lambda: allocate_kv_caches(layers, blocks, 16, 2, 8, torch.float32, torch.device("cpu"))  # noqa: E731
    theirs, mine = make(), make()
    for c in theirs:
        c.copy_(torch.randn_like(c))
    producer, consumer = MooncakeWorker(theirs, MooncakeOptions()), MooncakeWorker(mine, MooncakeOptions())
    holds = _Holds()
    holds.deadline["req"] = float("inf")
    info = producer.info()
    theirs_ids = list(range(blocks))
    holds.where["req"] = where_digest(theirs_ids, info["base"], blocks)
    channel = _SideChannel(("127.0.0.1", 0), "engine", holds)
    threading.Thread(target=channel.serve_forever, daemon=True).start()
    try:
        rng = random.Random(0)
        pairs = list(zip(rng.sample(range(blocks), 40), rng.sample(range(blocks), 40)))
        address = f"127.0.0.1:{info['rpc_port']}"
        where = where_digest(theirs_ids, info["base"], blocks)
        pull = RemotePull(address, channel.server_address[:2], "engine", "req", info["base"], blocks, where, pairs)
        assert len(consumer._ranges(pull)[2]) > 2048
        consumer.execute(KVConnectorMetadata(remote_pulls=[pull]))
        assert consumer.failed == [] and holds.released == ["req"]
        for layer in range(layers):
            for remote, local in pairs:
                assert torch.equal(mine[layer][:, local], theirs[layer][:, remote])
            untouched = sorted(set(range(blocks)) - {local for _, local in pairs})
            assert not mine[layer][:, untouched].any()
        # the same pull again: the producer no longer holds the blocks, so the read is refused as failed
        consumer.execute(KVConnectorMetadata(remote_pulls=[pull]))
        assert sorted(consumer.failed) == sorted(local for _, local in pairs)
    finally:
        channel.shutdown()
        channel.server_close()
