"""`pagedllm bench soak`: run a server under sustained abuse for N minutes, then prove it lost and leaked nothing.

It starts ``pagedllm serve`` itself (it reads the server's memory, file descriptors and threads
from /proc) and drives it with a seeded mix of clients:

* well-behaved ones: completions and chat, streamed and not, some with ``n`` > 1 and stop strings;
* careless ones (10 %): a stream dropped after a few chunks;
* Responses API clients (5 %): stored responses with a 1 MiB ``user`` field, read back, some deleted; the
  warm-up fills the store past its byte cap (``--max-stored-response-bytes``), so it evicts from then on;
* hostile ones (5 %): huge numbers, NaN, a 10 MB body, JSON nested 100 000 deep, unknown fields,
  invalid UTF-8, a prompt 100x the context, an unknown model, and each class that once stopped the
  engine (integers past 64 bits, floats at the edges of float64, a mask that leaves no legal token,
  lone UTF-16 surrogates), and requests without the API key (the server runs with ``--api-key``);
* half-sent requests: every burst period, 10 connections that send half a header and 10 that send half
  a body, each of which the server must close within its header and body deadlines;
* bursts at 5x what the server can hold (running + queued), which it must refuse with 503 and
  ``Retry-After``.

Then it waits for the server to go idle and checks:

* every answer was one the request deserved (200 for good ones, the right 4xx for hostile
  ones, 503 with Retry-After only as backpressure, no other 5xx, no hang, no broken stream);
  a good answer obeys the request (``n`` choices, no stop string in the text);
* no engine restart was needed (``pagedllm:engine_restarts_total`` is 0: no valid request faulted);
* every accepted request either completed or was aborted by its own client, by the server's own
  count (``pagedllm:request_success_total``);
* the KV cache is empty again and the block pool's invariants hold (``/v1/engine/state?check=true``);
* after warm-up, RSS stays within 5 % of what it was at the end of warm-up (the KV cache is
  made resident at start-up, ``--kv-cache-prefault``, so RSS measures everything else), and
  file descriptors and threads, idle before and idle after, do not grow.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

WORDS = (
    "the river town market old bridge morning light quiet street bakery window children garden "
    "story about a small dog who learned to read letters from the sea captain evening rain "
    "mountain path winter fire kitchen table song friend journey home lantern harbour"
).split()
STOPS = ["\n", " the", "."]
HOSTILE = (
    "huge_max_tokens",
    "huge_logprobs",
    "nan",
    "huge_body",
    "deep_json",
    "unknown_field",
    "invalid_utf8",
    "long_prompt",
    "huge_n",
    "negative_temperature",
    "unknown_model",
    # the classes that once stopped the engine for everyone (issue 57), and requests without the key
    "seed_past_64_bits",
    "top_k_past_64_bits",
    "huge_temperature",
    "tiny_penalty",
    "no_legal_token",
    "token_id_past_64_bits",
    "lone_surrogate_prompt",
    "lone_surrogate_message",
    "no_key_completion",
    "no_key_tokenize",
)
# the other hostile requests get 400 (a max_tokens of 10**18 too: the context has no room for it, as in vLLM)
_EXPECTED = {"huge_body": {413}, "unknown_model": {404}, "no_key_completion": {401}, "no_key_tokenize": {401}}
# the `param` the 400 of each class that once stopped the engine must name: refused for its own reason
_PARAM = {
    "seed_past_64_bits": "seed",
    "top_k_past_64_bits": "top_k",
    "huge_temperature": "temperature",
    "tiny_penalty": "repetition_penalty",
    "no_legal_token": "allowed_token_ids",
    "token_id_past_64_bits": "allowed_token_ids",
    "lone_surrogate_prompt": "prompt",
    "lone_surrogate_message": "messages",
}
STORED_USER_BYTES = 1 << 20  # the `user` field of each stored response
HALF_SENT_MARGIN_S = 10.0  # a half-sent request must be closed within its deadline plus this


@dataclass
class SoakConfig:
    minutes: float = 3.0
    seed: int = 0
    clients: int = 8
    warmup_fraction: float = 0.25
    burst_every_s: float = 30.0
    burst_factor: int = 5
    max_num_seqs: int = 16
    max_queue_len: int = 16
    max_model_len: int = 256
    max_tokens: int = 48
    kv_cache_bytes: int = 1 << 30
    rss_tolerance: float = 0.05
    idle_settle_s: float = 12.0  # idle threads of the server's thread pools exit after 10 s
    request_timeout_s: float = 30.0
    """The server's --request-header-timeout and --request-body-timeout: how long a half-sent request may hang on."""
    half_sent: int = 20
    """Half-sent connections a round, a round each burst period (half stall in their header, half in their body)."""
    stored_response_bytes: int = 8 << 20
    """The server's --max-stored-response-bytes: the warm-up stores responses past it."""
    onednn_cache_capacity: int | None = None
    """The server's oneDNN primitive caches (the engine's default, 128 each, when None): they grow with each new
    batch row count until full, which a short soak on a slow machine may not reach in its warm-up."""


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # (kind, outcome) -> count
    problems: list[str] = field(default_factory=list)
    completed: int = 0  # accepted and answered in full
    client_aborted: int = 0  # accepted, then dropped by its client on purpose
    rejected_503: int = 0

    def problem(self, text: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(text)
        self.outcomes[("problem", text.split(":")[0])] += 1


def _names_param(r, param: str) -> bool:
    """Whether an OpenAI-shaped error names ``param`` (or a part of it: ``messages.0.content``)."""
    try:
        named = r.json()["error"].get("param") or ""
    except (ValueError, KeyError, AttributeError):
        return False
    return named == param or named.startswith((param + ".", param + "["))


def _prompt(rng: random.Random, lo: int = 4, hi: int = 40) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


class Soak:
    def __init__(self, url: str, model: str, config: SoakConfig, headers: dict | None = None):
        self.url, self.model, self.c = url, model, config
        self.headers = headers or {}
        self.tally = Tally()
        self.end = 0.0
        self.token_id, self.word = 0, ""  # one token and its text, for the masks that leave nothing (prepare())

    async def prepare(self, client) -> None:
        """The id and text of one token of the served model's vocabulary (through /tokenize, with the key)."""
        r = await client.post(
            self.url + "/tokenize", json={"prompt": " hello", "add_special_tokens": False}, headers=self.headers
        )
        r.raise_for_status()
        self.token_id = r.json()["tokens"][0]
        r = await client.post(self.url + "/detokenize", json={"tokens": [self.token_id]}, headers=self.headers)
        r.raise_for_status()
        self.word = r.json()["prompt"].strip()

    # -- one request of each kind ------------------------------------------------------------------
    async def _good(self, client, rng: random.Random, kind: str) -> None:
        chat = rng.random() < 0.4
        body: dict = {
            "model": self.model,
            "max_tokens": rng.randint(1, self.c.max_tokens),
            "temperature": rng.choice([0.0, 0.7, 1.0]),
            "seed": rng.randrange(1 << 30),
        }
        if chat:
            body["messages"] = [{"role": "user", "content": _prompt(rng)}]
        else:
            body["prompt"] = _prompt(rng)
        n = 1
        if kind == "n_stop":
            n = rng.randint(2, 4)
            body.update(n=n, stop=STOPS)
        stream = kind == "stream" or (kind == "n_stop" and rng.random() < 0.5)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if not stream:
            r = await client.post(self.url + path, json=body, headers=self.headers)
            if not self._status_ok(kind, r):
                return
            choices = r.json()["choices"]
            texts = [(c["message"]["content"] if chat else c["text"]) or "" for c in choices]
            self._check_answer(kind, n, texts, [c["finish_reason"] for c in choices])
            return
        body["stream"] = True
        async with client.stream("POST", self.url + path, json=body, headers=self.headers) as r:
            if not self._status_ok(kind, r):
                await r.aread()
                return
            texts, reasons, done = [""] * n, [None] * n, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.tally.problem(f"stream error event: {chunk['error']}")
                    return
                for c in chunk["choices"]:
                    piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                    texts[c["index"]] += piece or ""
                    reasons[c["index"]] = c.get("finish_reason") or reasons[c["index"]]
            if not done:
                self.tally.problem(f"{kind}: stream ended without [DONE]")
                return
            self._check_answer(kind, n, texts, reasons)

    def _status_ok(self, kind: str, r) -> bool:
        if r.status_code == 200:
            return True
        if r.status_code == 503 and r.headers.get("retry-after"):
            self.tally.rejected_503 += 1
            self.tally.outcomes[(kind, "503")] += 1
        else:
            self.tally.problem(f"{kind}: HTTP {r.status_code}")
        return False

    def _check_answer(self, kind: str, n: int, texts: list[str], reasons: list) -> None:
        if len(texts) != n or any(reason not in ("stop", "length") for reason in reasons):
            self.tally.problem(f"{kind}: {len(texts)} choices for n={n}, finish reasons {reasons}")
        elif kind == "n_stop" and any(s in t for t in texts for s in STOPS):
            self.tally.problem(f"{kind}: a stop string in the output {texts}")
        else:
            self.tally.completed += 1
            self.tally.outcomes[(kind, "200")] += 1

    async def _responses(self, client, rng: random.Random, kind: str = "responses", delete: bool = True) -> str | None:
        """A stored response with a 1 MiB ``user``, read back; a third of them deleted, then gone (404). Its id
        when it is still stored."""
        body = {
            "model": self.model,
            "input": _prompt(rng),
            "max_output_tokens": rng.randint(1, self.c.max_tokens),
            "temperature": 0.0,
            "store": True,
            "user": "u" * STORED_USER_BYTES,
        }
        r = await client.post(self.url + "/v1/responses", json=body, headers=self.headers)
        if not self._status_ok(kind, r):
            return None
        answer = r.json()
        if answer.get("status") not in ("completed", "incomplete") or not answer.get("id"):
            self.tally.problem(f"{kind}: status {answer.get('status')}")
            return None
        url = f"{self.url}/v1/responses/{answer['id']}"
        got = await client.get(url, headers=self.headers)  # evicted already only if the store is tiny
        if got.status_code != 200 or got.json()["id"] != answer["id"]:
            self.tally.problem(f"{kind}: reading a stored response back: HTTP {got.status_code}")
            return None
        kept: str | None = answer["id"]
        if delete and rng.random() < 1 / 3:
            gone = await client.delete(url, headers=self.headers)
            again = await client.get(url, headers=self.headers)
            if gone.status_code != 200 or again.status_code != 404:
                self.tally.problem(f"{kind}: DELETE gave {gone.status_code}, then GET {again.status_code}")
                return None
            kept = None
        self.tally.completed += 1
        self.tally.outcomes[(kind, "200")] += 1
        return kept

    async def _half_sent(self) -> None:
        """One round: ``half_sent`` connections stall, half in their header and half in their body; each must be
        closed by the server (the body's after a 408) within its deadline plus a margin."""
        host, port = self.url.removeprefix("http://").split(":")
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        for name, value in self.headers.items():  # with the key: one without it is refused before its body is read
            head += f"{name}: {value}\r\n".encode()

        async def one(i: int) -> None:
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                half_body = i % 2 == 0
                writer.write(head + b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "' if half_body else head[:50])
                await writer.drain()
                deadline = self.c.request_timeout_s + HALF_SENT_MARGIN_S
                try:
                    got = await asyncio.wait_for(reader.read(), deadline)  # until the server closes it
                except asyncio.TimeoutError:
                    self.tally.problem(f"half-sent: still open after {deadline:.0f} s")
                    return
                if half_body and not got.startswith(b"HTTP/1.1 408"):
                    self.tally.problem(f"half-sent: a stalled body was answered {got[:40]!r}, not 408")
                    return
                self.tally.outcomes[("half_sent", "closed")] += 1
            finally:
                writer.close()

        # every connection of the round ends (closed, timed out or failed) before the next round starts
        for failed in await asyncio.gather(*(one(i) for i in range(self.c.half_sent)), return_exceptions=True):
            if isinstance(failed, BaseException):
                self.tally.problem(f"half-sent: {type(failed).__name__}: {failed}")

    async def _half_sent_rounds(self) -> None:
        while time.monotonic() < self.end:
            await self._half_sent()
            await asyncio.sleep(max(0.0, min(self.c.burst_every_s, self.end - time.monotonic())))

    async def _disconnect(self, client, rng: random.Random) -> None:
        body = {
            "model": self.model,
            "prompt": _prompt(rng),
            "max_tokens": self.c.max_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0.8,
        }
        after = rng.randint(1, 5)
        async with client.stream("POST", self.url + "/v1/completions", json=body, headers=self.headers) as r:
            if not self._status_ok("disconnect", r):
                await r.aread()
                return
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= after:
                        break  # leaving the block drops the connection mid-stream
        self.tally.client_aborted += 1
        self.tally.outcomes[("disconnect", "dropped")] += 1

    async def _hostile(self, client, rng: random.Random, what: str | None = None) -> None:
        what = what or rng.choice(HOSTILE)
        base = {"model": self.model, "prompt": "hello", "max_tokens": 4}
        raw: bytes
        path, headers = "/v1/completions", self.headers
        if what == "huge_max_tokens":
            raw = json.dumps({**base, "max_tokens": 10**18, "ignore_eos": True}).encode()
        elif what == "huge_logprobs":
            raw = json.dumps({**base, "logprobs": 10**9}).encode()
        elif what == "nan":
            raw = json.dumps({**base, "temperature": float("nan")}).encode()  # Python writes the NaN literal
        elif what == "huge_body":
            raw = json.dumps({**base, "prompt": "x" * (10 << 20)}).encode()
        elif what == "deep_json":
            raw = b"[" * 100_000 + b"]" * 100_000
        elif what == "unknown_field":
            raw = json.dumps({**base, "definitely_not_a_field": 1}).encode()
        elif what == "invalid_utf8":
            raw = b'{"model": "x", "prompt": "\xff\xfe\xfd"}'
        elif what == "long_prompt":
            raw = json.dumps({**base, "prompt": "word " * (100 * self.c.max_model_len)}).encode()
        elif what == "huge_n":
            raw = json.dumps({**base, "n": 10**9}).encode()
        elif what == "negative_temperature":
            raw = json.dumps({**base, "temperature": -1}).encode()
        elif what == "seed_past_64_bits":
            raw = json.dumps({**base, "seed": 2**70}).encode()
        elif what == "top_k_past_64_bits":
            raw = json.dumps({**base, "top_k": 2**64, "temperature": 1.0}).encode()
        elif what == "huge_temperature":
            raw = json.dumps({**base, "temperature": 1e308}).encode()
        elif what == "tiny_penalty":
            raw = json.dumps({**base, "repetition_penalty": 1e-300, "temperature": 1.0}).encode()
        elif what == "no_legal_token":  # the one allowed token is banned too
            raw = json.dumps({**base, "allowed_token_ids": [self.token_id], "bad_words": [self.word]}).encode()
        elif what == "token_id_past_64_bits":
            raw = json.dumps({**base, "allowed_token_ids": [self.token_id, 2**70]}).encode()
        elif what == "lone_surrogate_prompt":  # json.dumps writes it as the escape "\\ud800": the only way one travels
            raw = json.dumps({**base, "prompt": "hi \ud800 there"}).encode()
        elif what == "lone_surrogate_message":
            body = {"model": self.model, "max_tokens": 4, "messages": [{"role": "user", "content": "a \udfff"}]}
            raw = json.dumps(body).encode()
            path = "/v1/chat/completions"
        elif what == "no_key_completion":
            raw, headers = json.dumps(base).encode(), {}
        elif what == "no_key_tokenize":
            raw, headers, path = json.dumps({"prompt": "hello " * 1000}).encode(), {}, "/tokenize"
        else:
            raw = json.dumps({**base, "model": "no-such-model"}).encode()
        r = await client.post(self.url + path, content=raw, headers={**headers, "content-type": "application/json"})
        want = _EXPECTED.get(what, {400})
        param = _PARAM.get(what)
        if r.status_code in want and param is not None and not _names_param(r, param):
            self.tally.problem(f"hostile {what}: a {r.status_code} not naming {param!r}: {r.text[:200]}")
        elif r.status_code in want:
            self.tally.outcomes[("hostile", what)] += 1
        elif r.status_code == 503 and r.headers.get("retry-after"):
            self.tally.rejected_503 += 1
        else:
            self.tally.problem(f"hostile {what}: HTTP {r.status_code}, wanted {sorted(want)}: {r.text[:200]}")

    async def _one(self, client, rng: random.Random, kind: str | None = None) -> None:
        """One request of ``kind`` (drawn from the mix when None), its failure recorded, never raised."""
        if kind is None:
            x = rng.random()
            kind = (
                "hostile"
                if x < 0.05
                else "disconnect"
                if x < 0.15
                else "n_stop"
                if x < 0.30
                else "stream"
                if x < 0.55
                else "chat"
                if x < 0.70
                else "responses"
                if x < 0.75
                else "complete"
            )
        try:
            if kind == "hostile":
                await self._hostile(client, rng)
            elif kind == "responses":
                await self._responses(client, rng)
            elif kind == "disconnect":
                await self._disconnect(client, rng)
            else:
                await self._good(client, rng, kind)
        except Exception as e:
            import httpx

            if isinstance(e, httpx.TimeoutException):  # we hung up: the server aborts it (still a problem)
                self.tally.client_aborted += 1
            self.tally.problem(f"{kind}: {type(e).__name__}: {e}")

    async def _client(self, client, i: int) -> None:
        rng = random.Random(self.c.seed * 1000 + i)
        while time.monotonic() < self.end:
            await self._one(client, rng)

    async def _bursts(self, client) -> None:
        rng = random.Random(self.c.seed * 1000 - 1)
        size = self.c.burst_factor * (self.c.max_num_seqs + self.c.max_queue_len)
        while time.monotonic() + self.c.burst_every_s < self.end:
            await asyncio.sleep(self.c.burst_every_s)
            rngs = [random.Random(rng.random()) for _ in range(size)]
            await asyncio.gather(*(self._one(client, r, "burst") for r in rngs))

    async def run(self, seconds: float) -> None:
        async with self._http() as client:
            self.end = time.monotonic() + seconds
            await asyncio.gather(
                self._bursts(client),
                self._half_sent_rounds(),
                *(self._client(client, i) for i in range(self.c.clients)),
            )

    async def every_path_once(self) -> None:
        """Each kind of request once, every hostile one included, then one burst at full size: the start of the
        warm-up, so that what the main phase allocates has been allocated once whatever this machine's speed
        (a time-only warm-up on a slow day may never send the 10 MB body)."""
        rng = random.Random(self.c.seed * 1000 - 2)
        size = self.c.burst_factor * (self.c.max_num_seqs + self.c.max_queue_len)
        async with self._http() as client:
            await self.prepare(client)
            for kind in ("complete", "chat", "stream", "n_stop", "disconnect"):
                await self._one(client, rng, kind)
            for what in HOSTILE:
                await self._hostile(client, rng, what)
            # the store past its byte cap: the first response stored is evicted
            first = await self._responses(client, rng, delete=False)
            for _ in range(self.c.stored_response_bytes // STORED_USER_BYTES + 2):
                await self._responses(client, rng, delete=False)
            if first is not None:
                got = await client.get(f"{self.url}/v1/responses/{first}", headers=self.headers)
                if got.status_code != 404:
                    self.tally.problem(f"responses: the store kept its first response past its byte cap ({got})")
            await self._half_sent()
            await asyncio.gather(*(self._one(client, random.Random(rng.random()), "burst") for _ in range(size)))

    def _http(self):
        import httpx

        from pagedllm.entrypoints.graceful_server import client_limits

        return httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=client_limits(None, 64))


# -- the server process and what it holds ---------------------------------------------------------------


def proc_stats(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()

    def get(key: str) -> int:
        found = re.search(rf"^{key}:\s+(\d+)", status, re.M)
        assert found is not None, f"/proc/{pid}/status has no {key}"
        return int(found.group(1))

    return {"rss_mib": get("VmRSS") / 1024, "threads": get("Threads"), "fds": len(os.listdir(f"/proc/{pid}/fd"))}


class Sampler:
    """The server's RSS, fds and threads every ``every`` seconds, on a thread of its own."""

    def __init__(self, pid: int, every: float = 1.0):
        import threading

        self.pid, self.every = pid, every
        self.samples: list[tuple[float, dict]] = []  # (monotonic time, proc_stats)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append((time.monotonic(), proc_stats(self.pid)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _finished_counts(url: str) -> dict:
    import httpx

    text = httpx.get(url + "/metrics").text
    name = "pagedllm:request_success_total"
    return {r: _metric_sum(text, name, finished_reason=r) for r in ("stop", "length", "abort")}


def wait_idle(url: str, headers: dict, timeout: float = 120.0) -> dict:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        state = httpx.get(url + "/v1/engine/state", params={"check": "true"}, headers=headers, timeout=30).json()
        if (state["num_running"] == 0 and state["num_waiting"] == 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def start_server(model: str, config: SoakConfig, extra: list[str], log) -> tuple[subprocess.Popen, str]:
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the KV cache resident from the start (--kv-cache-prefault), so RSS measures everything else: without
    # it, pages of the cache become resident as the free queue first hands out each block, which looks
    # like steady growth until the whole cache has been used once
    cmd = [
        sys.executable,
        "-m",
        "pagedllm.entrypoints.cli",
        "serve",
        model,
        "--port",
        str(port),
        "--max-num-seqs",
        str(config.max_num_seqs),
        "--max-queue-len",
        str(config.max_queue_len),
        "--max-model-len",
        str(config.max_model_len),
        "--kv-cache-memory",
        str(config.kv_cache_bytes),
        "--kv-cache-prefault",
        "--request-header-timeout",
        str(config.request_timeout_s),
        "--request-body-timeout",
        str(config.request_timeout_s),
        "--max-stored-response-bytes",
        str(config.stored_response_bytes),
        "--uvicorn-log-level",
        "warning",
        *extra,
    ]
    env = dict(os.environ)
    if config.onednn_cache_capacity is not None:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = env["LRU_CACHE_CAPACITY"] = str(config.onednn_cache_capacity)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become healthy in 600 s")


def soak(model: str, config: SoakConfig, extra: Sequence[str] = (), served_name: str = "soak") -> dict:
    """Start a server on ``model``, soak it, stop it; the report (``report["problems"]`` empty when it held)."""
    import httpx

    key = secrets.token_hex(16)
    with tempfile.TemporaryFile(mode="w+") as log:  # the server's output; its process keeps its own descriptor
        proc, url = start_server(model, config, ["--served-model-name", served_name, "--api-key", key, *extra], log)
    headers = {"Authorization": f"Bearer {key}"}
    try:
        soaker = Soak(url, served_name, config, headers)
        total = config.minutes * 60
        warmup = total * config.warmup_fraction
        asyncio.run(soaker.every_path_once())  # warm-up: every path taken once, then the mix: caches and pools grown
        asyncio.run(soaker.run(warmup))
        wait_idle(url, headers)
        time.sleep(config.idle_settle_s)
        idle_before = proc_stats(proc.pid)
        finished_before = _finished_counts(url)
        accepted_before = soaker.tally.completed + soaker.tally.client_aborted
        sampler = Sampler(proc.pid)
        t_main = time.monotonic()
        asyncio.run(soaker.run(total - warmup))
        state = wait_idle(url, headers)
        sampler.stop()
        time.sleep(config.idle_settle_s)
        idle_after = proc_stats(proc.pid)
        finished_after = _finished_counts(url)
        final = httpx.post(
            url + "/v1/completions",
            json={"model": served_name, "prompt": "still there?", "max_tokens": 4},
            headers=headers,
            timeout=60,
        )
        metrics = httpx.get(url + "/metrics").text
        restarts = _metric_sum(metrics, "pagedllm:engine_restarts_total")
        store_bytes = _metric_sum(metrics, "pagedllm:responses_store_bytes")
    finally:
        proc.terminate()
        code: int | None
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = None
    t = soaker.tally
    problems = list(t.problems)
    # the server's own count: every request accepted in the main phase finished or was aborted by its client
    accepted = t.completed + t.client_aborted - accepted_before
    done = {k: finished_after[k] - finished_before[k] for k in finished_after}
    if done["stop"] + done["length"] + done["abort"] != accepted:
        problems.append(f"the server finished {done} requests, the clients had {accepted} accepted")
    if done["abort"] > t.client_aborted:
        problems.append(f"the server aborted {done['abort']} requests, the clients dropped {t.client_aborted}")
    leaked = state["blocks"]["used"] + state["blocks"]["shared"]
    if state["num_running"] or state["num_waiting"] or leaked or state["kv_cache_usage"] != 0:
        problems.append(
            f"not idle at the end: {state['num_running']} running, {state['num_waiting']} waiting, {leaked} blocks held"
        )
    if state.get("invariants") != "ok":
        problems.append(f"block pool invariants: {state.get('invariants')}")
    rss = [s["rss_mib"] for _, s in sampler.samples]
    step = max(1, len(rss) // 12)
    timeline = [[round(t - t_main), round(s["rss_mib"])] for t, s in sampler.samples[::step]]
    peak_rss = max(rss + [idle_after["rss_mib"]])
    if peak_rss > idle_before["rss_mib"] * (1 + config.rss_tolerance):
        problems.append(f"RSS grew from {idle_before['rss_mib']:.0f} MiB to a peak of {peak_rss:.0f} MiB")
    for key in ("fds", "threads"):
        if idle_after[key] > idle_before[key]:
            problems.append(f"{key}: {idle_before[key]} idle before, {idle_after[key]} idle after")
    if final.status_code != 200:
        problems.append(f"a request after the soak got HTTP {final.status_code}")
    if restarts:
        problems.append(f"the engine restarted {restarts:.0f} times: a request faulted in a step")
    if not 0 < store_bytes <= config.stored_response_bytes:
        problems.append(f"the Responses store holds {store_bytes:.0f} bytes, its cap {config.stored_response_bytes}")
    if code != 0:
        problems.append(f"the server exited with {code} on SIGTERM")
    bursts_503 = t.outcomes.get(("burst", "503"), 0)
    if config.minutes * 60 * (1 - config.warmup_fraction) > config.burst_every_s and bursts_503 == 0:
        problems.append("no burst was refused with 503: the bursts did not exceed the server's capacity")
    five_xx = sum(v for (kind, what), v in t.outcomes.items() if kind == "problem" and "HTTP 5" in what)
    return {
        "minutes": config.minutes,
        "seed": config.seed,
        "clients": config.clients,
        "requests": sum(v for (kind, _), v in t.outcomes.items() if kind != "problem") + len(t.problems),
        "completed": t.completed,
        "client_aborted": t.client_aborted,
        "rejected_503": t.rejected_503,
        "server_finished_main_phase": done,
        "unexpected_5xx": five_xx,
        "engine_restarts": restarts,
        "responses_store_bytes": store_bytes,
        "outcomes": {f"{k}/{v}": n for (k, v), n in sorted(t.outcomes.items())},
        "rss_mib": {
            "idle_after_warmup": idle_before["rss_mib"],
            "peak": peak_rss,
            "idle_at_end": idle_after["rss_mib"],
            "timeline": timeline,
        },
        "fds": {"before": idle_before["fds"], "after": idle_after["fds"]},
        "threads": {"before": idle_before["threads"], "after": idle_after["threads"]},
        "leaked_blocks": leaked,
        "invariants": state.get("invariants"),
        "main_phase_s": round(time.monotonic() - t_main, 1),
        "problems": problems,
    }


def add_parser(sub) -> None:
    from pagedllm.entrypoints.cli_args import add_command

    p = add_command(sub, "soak", help="run a server under sustained abuse and check it lost and leaked nothing")
    p.add_argument("model", nargs="?", default=None, help="model to serve (default: the embedded SmolLM2)")
    p.add_argument("--minutes", type=float, default=30.0, help="how long, warm-up included")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients, each sending one request at a time")
    p.add_argument("--burst-every", type=float, default=30.0, help="seconds between bursts")
    p.add_argument("--max-num-seqs", type=int, default=16, help="the server's --max-num-seqs")
    p.add_argument("--max-queue-len", type=int, default=16, help="the server's --max-queue-len")
    p.add_argument("--max-model-len", type=int, default=512, help="the server's --max-model-len")
    p.add_argument("--server-arg", action="append", default=[], help="one more argument for pagedllm serve")
    p.add_argument("--result-file", default=None, help="write the JSON report here")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import logging

    from pagedllm.benchmarks.optional import require

    require("pagedllm bench soak", "httpx", "pip install httpx", "to drive its server")

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    model = args.model
    if model is None:
        from pagedllm.model_loader.resolve import default_model_path

        model = default_model_path()
    config = SoakConfig(
        minutes=args.minutes,
        seed=args.seed,
        clients=args.clients,
        burst_every_s=args.burst_every,
        max_num_seqs=args.max_num_seqs,
        max_queue_len=args.max_queue_len,
        max_model_len=args.max_model_len,
    )
    report = soak(model, config, args.server_arg)
    text = json.dumps(report, indent=2)
    print(text)
    if args.result_file:
        Path(args.result_file).write_text(text)
    return 0 if not report["problems"] else 1
