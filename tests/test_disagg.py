"""Disaggregated prefill / decode: `pagedllm disagg-proxy` in front of a prefill server and a decode server
that share a disk KV tier (kv_producer writes each prompt's blocks, kv_consumer loads them)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tempfile

import httpx
import pytest

from pagedllm.entrypoints.router import prefill_body

from utils import MODEL, Server, _free_port, wait_healthy

PROMPTS = [
    f"Document {k}: " + " ".join(f"word{(k * 37 + i) % 97}" for i in range(60)) + " Summarise it." for k in range(4)
]


class Proxy:
    def __init__(self, prefill: str, decode: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagedllm.entrypoints.cli",
                "disagg-proxy",
                "--port",
                str(self.port),
                "--prefill",
                prefill,
                "--decode",
                decode,
                "--health-check-interval",
                "0.3",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        wait_healthy(self.url, self.proc, timeout=60)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _tier(path: str, role: str) -> str:
    return json.dumps({"kv_connector": "DiskConnector", "kv_role": role, "kv_connector_extra_config": {"path": path}})


@pytest.fixture(scope="module")
def pair(tiny_model_factory, tmp_path_factory):
    model = str(tiny_model_factory("llama"))
    path = str(tmp_path_factory.mktemp("kv"))
    prefill = Server(model, "--kv-transfer-config", _tier(path, "kv_producer"))
    decode = Server(model, "--kv-transfer-config", _tier(path, "kv_consumer"))
    yield prefill, decode
    for s in (prefill, decode):
        s.stop()


def _complete(url: str, prompt: str, stream: bool = False) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_prefill_body_keeps_the_prompt_and_asks_for_one_token():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function"}],
        "stream": True,
        "n": 3,
        "max_completion_tokens": 50,
        "min_tokens": 5,
        "logprobs": True,
        "response_format": {"type": "json_object"},
        "temperature": 0.7,
    }
    out = prefill_body(body)
    assert out == {
        "model": "m",
        "messages": body["messages"],
        "tools": body["tools"],
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True},  # vLLM's protocol: hold the blocks for a decode engine
    }


def test_decode_server_loads_the_prefill_servers_blocks_and_answers_the_same(pair):
    prefill, decode = pair
    proxy = Proxy(prefill.url, decode.url)
    try:
        hits, tokens = (
            decode.metric("pagedllm:external_prefix_cache_hits_total"),
            decode.metric("pagedllm:prompt_tokens_total"),
        )
        got = [
            _complete(proxy.url, PROMPTS[0]),
            _complete(proxy.url, PROMPTS[1], stream=True),
            *(_complete(proxy.url, p) for p in PROMPTS[2:]),
        ]
        assert proxy.metric("pagedllm_router:prefills_total{") == len(PROMPTS)
        # the decode engine computed only each prompt's last partial block: the rest was the prefill engine's
        loaded = decode.metric("pagedllm:external_prefix_cache_hits_total") - hits
        computed = decode.metric("pagedllm:prompt_tokens_total") - tokens
        assert loaded > 0 and computed < 16 * len(PROMPTS), (loaded, computed)
        tier_bytes = {
            m[0]: float(m[1])
            for m in re.findall(
                r'^pagedllm:kv_offload_bytes_total\{direction="(\w+)",model_name="[^"]*",tier="disk"\} (\S+)$',
                httpx.get(f"{decode.url}/metrics").text,
                re.M,
            )
        }
        assert set(tier_bytes) == {"save", "load"} and tier_bytes["load"] > 0, tier_bytes
        assert got == [_complete(prefill.url, p) for p in PROMPTS]  # what one engine answers alone
    finally:
        proxy.stop()


def test_a_decode_server_whose_prefill_server_is_gone_computes_the_prompt_itself(pair):
    _, decode = pair
    prompt = "A prompt nobody prefilled: " + " ".join(f"token{i}" for i in range(50))
    expected = _complete(decode.url, prompt)
    proxy = Proxy(f"http://127.0.0.1:{_free_port()}", decode.url)  # nothing listens there
    try:
        assert _complete(proxy.url, prompt + " again") == _complete(decode.url, prompt + " again")
        assert _complete(proxy.url, prompt) == expected
        assert proxy.metric("pagedllm_router:prefills_total{") == 2
        assert "unreachable" in httpx.get(f"{proxy.url}/metrics").text
    finally:
        proxy.stop()
