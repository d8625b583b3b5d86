"""`GET /dashboard` in a real browser (Debian's Chromium driven by Playwright) against a live server under
load, and the snapshot stream behind it: one snapshot per interval however many watch, none when nobody does."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from utils import MODEL, Server

KEY = "dashboard-secret"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's Chromium, which the README's test command installs (apt-get install chromium) before the suite."""
    path = shutil.which("chromium")
    if path is None:
        pytest.fail(
            "the dashboard test needs Debian's chromium: the README's test command installs it "
            "(apt-get install chromium, as root)"
        )
    return path


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    s = Server(
        str(tiny_model_factory("llama")),
        "--api-key",
        KEY,
        "--engine-state-interval",
        "0.25",
        "--max-model-len",
        "512",
        "--num-gpu-blocks-override",
        "96",
        "--max-num-seqs",
        "4",
    )
    yield s
    s.stop()


def _state(server: Server) -> dict:
    return httpx.get(f"{server.url}/v1/engine/state", headers={"Authorization": f"Bearer {KEY}"}).json()


class Load:
    """Streams that keep the engine busy (and queueing: 6 clients, 4 sequences at most) until stopped."""

    def __init__(self, url: str):
        self.url, self.stop_flag, self.sent = url, threading.Event(), 0
        self.threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(6)]
        for t in self.threads:
            t.start()

    def client(self, i: int) -> None:
        shared = "A long shared system prompt for every dashboard client, so blocks are cached. " * 4
        with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
            k = 0
            while not self.stop_flag.is_set():
                body = {
                    "model": MODEL,
                    "prompt": shared + f"client {i} request {k}",
                    "max_tokens": 180,
                    "temperature": 0.8,
                    "seed": k,
                    "ignore_eos": True,
                    "n": 2 if i % 2 else 1,
                }
                with c.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                    assert r.status_code == 200, r.read()
                    for _ in r.iter_bytes():
                        if self.stop_flag.is_set():
                            break
                self.sent += 1
                k += 1

    def stop(self) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(60)


def _page_view(page) -> dict:
    """What the page shows, read in one go (between two snapshots): its counts, its queue rows, and its block
    grid read back from the canvas, checking every cell has its kind's colour (the drawing, not just the data)."""
    return page.evaluate("""() => {
        const text = (id) => +document.getElementById(id).textContent;
        const counts = {};
        for (const id of ['num-running', 'num-waiting', 'blocks-free', 'blocks-cached', 'blocks-used',
                          'blocks-shared', 'num-finished']) counts[id] = text(id);
        const c = document.getElementById('block-grid'), map = c.dataset.map;
        const cell = +c.dataset.cell, perRow = +c.dataset.perRow, ratio = window.devicePixelRatio || 1;
        const ctx = c.getContext('2d');
        const want = {'.': '--free', 'c': '--cached', 'u': '--used', 's': '--shared'};
        const hex = (v) => getComputedStyle(document.documentElement).getPropertyValue(v).trim();
        let wrong = 0;
        for (let i = 0; i < map.length; i++) {
            const x = Math.floor(((i % perRow) * cell + 1) * ratio);
            const y = Math.floor((Math.floor(i / perRow) * cell + 1) * ratio);
            const [r, g, b] = ctx.getImageData(x, y, 1, 1).data;
            const got = '#' + [r, g, b].map((v) => v.toString(16).padStart(2, '0')).join('');
            if (got !== hex(want[map[i]])) wrong++;
        }
        return {counts, map, wrong, blocks: map.length,
                running_rows: document.querySelectorAll('#running-table tbody tr').length,
                waiting_rows: document.querySelectorAll('#waiting-table tbody tr').length};
    }""")


def test_dashboard_in_chromium_follows_the_engine_under_load(server, chromium, tmp_path):
    from playwright.sync_api import sync_playwright

    assert httpx.get(f"{server.url}/dashboard").status_code == 200  # the page holds no data: the stream is keyed
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            requests_made = []
            page.on("request", lambda r: requests_made.append(r.url))
            page.goto(f"{server.url}/dashboard#key={KEY}")
            page.wait_for_function("+document.getElementById('updates').textContent >= 2", timeout=30_000)
            assert page.text_content("#status") == "live"
            assert "#key" not in page.url  # the key left the address bar
            idle_before = _page_view(page)
            assert idle_before["wrong"] == 0 and idle_before["blocks"] == _state(server)["num_blocks"]

            load = Load(server.url)
            try:
                page.wait_for_function(
                    "+document.getElementById('num-running').textContent >= 2 && "
                    "+document.getElementById('num-waiting').textContent >= 1",
                    timeout=60_000,
                )
                page.wait_for_timeout(1000)  # a few snapshots of steady load for the sparklines
                # a view read in one go that shows the load: requests sharing the prompt's blocks, others queued (a
                # loaded machine can catch the engine between two requests: the next snapshot, within a minute)
                for _ in range(240):
                    busy = _page_view(page)
                    c = busy["counts"]
                    if c["blocks-shared"] > 0 and c["num-running"] >= 2 and c["num-waiting"] >= 1:
                        break
                    page.wait_for_timeout(250)
                live = _state(server)
                shot = Path(os.environ.get("PAGEDLLM_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))
                page.screenshot(path=str(shot), full_page=True)
                steps_text = page.text_content("#steps-summary")
                tput = page.text_content("#v-throughput")
            finally:
                load.stop()
            # under load: the grid shows used and shared blocks, drawn cell by cell from the snapshot's map
            n = busy["counts"]
            assert busy["wrong"] == 0 and busy["map"] != idle_before["map"]
            assert busy["map"].count("u") == n["blocks-used"] and busy["map"].count("s") == n["blocks-shared"] > 0
            assert busy["map"].count(".") == n["blocks-free"] and busy["map"].count("c") == n["blocks-cached"]
            assert busy["running_rows"] == n["num-running"] >= 2 and busy["waiting_rows"] == n["num-waiting"] >= 1
            assert live["num_blocks"] == busy["blocks"] and live["num_running"] >= 1
            assert "decode" in steps_text and float(tput) > 0

            # idle again: the page settles on exactly what /v1/engine/state says
            page.wait_for_function(
                "document.getElementById('num-running').textContent === '0' && "
                "document.getElementById('num-waiting').textContent === '0' && "
                "document.getElementById('blocks-used').textContent === '0' && "
                "document.getElementById('blocks-shared').textContent === '0'",
                timeout=60_000,
            )
            page.wait_for_timeout(600)  # one more snapshot after the last request finished
            idle = _page_view(page)
            state = _state(server)
            assert idle["wrong"] == 0 and idle["map"] == state["block_map"]
            assert idle["counts"] == {
                "num-running": state["num_running"],
                "num-waiting": state["num_waiting"],
                **{f"blocks-{k}": state["blocks"][k] for k in ("free", "cached", "used", "shared")},
                "num-finished": state["totals"]["finished_requests"],
            }
            assert state["blocks"]["cached"] > 0  # the shared system prompt stays cached after the load
            assert idle["running_rows"] == idle["waiting_rows"] == 0
            # no network fetch but this server
            assert requests_made and all(u.startswith(server.url) for u in requests_made), requests_made
        finally:
            browser.close()


def test_dashboard_without_the_key_asks_for_it(server, chromium):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(f"{server.url}/dashboard")
            page.wait_for_function("document.getElementById('status').textContent.startsWith('unauthorized')")
            assert page.is_visible("#key-form") and page.text_content("#updates") == "0"
            page.fill("#key-input", "wrong")
            page.click("#key-form button")
            page.wait_for_timeout(500)
            assert page.text_content("#status").startswith("unauthorized")
            page.fill("#key-input", KEY)
            page.click("#key-form button")
            page.wait_for_function("+document.getElementById('updates').textContent >= 1")
            assert page.text_content("#status") == "live" and not page.is_visible("#key-form")
        finally:
            browser.close()


def _read_events(url: str, n: int, out: list, headers: dict) -> None:
    with httpx.Client(timeout=30) as c, c.stream("GET", url, headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                if len(out) >= n:
                    return


def test_the_state_stream_takes_one_snapshot_per_interval_and_none_unwatched(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    stream_url = f"{server.url}/v1/engine/state/stream"
    assert httpx.get(stream_url).status_code == 401
    taken = lambda: server.metric("pagedllm:engine_state_snapshots_total")  # noqa: E731
    before = taken()
    time.sleep(1.5)
    assert taken() == before  # nobody watches: the engine pays nothing
    outs: list[list] = [[], [], []]
    t0 = time.monotonic()
    readers = [threading.Thread(target=_read_events, args=(stream_url, 8, out, auth)) for out in outs]
    for t in readers:
        t.start()
    for t in readers:
        t.join(30)
    elapsed = time.monotonic() - t0
    assert [len(o) for o in outs] == [8, 8, 8]
    grew = taken() - before
    assert 8 <= grew <= elapsed / 0.25 + 2, (grew, elapsed)  # three watchers share each snapshot
    times = [{s["time"] for s in o} for o in outs]
    assert len(times[0] & times[1] & times[2]) >= 6  # the very same snapshots
    snap = outs[0][-1]
    assert {"block_map", "running", "waiting", "steps", "totals", "ttft", "itl", "model"} <= snap.keys()
    time.sleep(1.0)  # the watchers are gone: snapshots stop
    settled = taken()
    time.sleep(1.0)
    assert taken() == settled


def test_sigterm_ends_dashboard_streams_and_drains_promptly(tiny_model_factory):
    # a graceful-shutdown timeout far above the bound below: a stream that never ended would cost all of it
    s = Server(str(tiny_model_factory("llama")), "--engine-state-interval", "0.2", "--shutdown-timeout", "120")
    got: list = []
    reader = threading.Thread(
        target=_read_events, args=(f"{s.url}/v1/engine/state/stream", 10**9, got, {}), daemon=True
    )
    reader.start()
    while not got:
        time.sleep(0.05)
    t0 = time.monotonic()
    assert s.stop() == 0
    assert time.monotonic() - t0 < 60  # not the 120 s graceful-shutdown timeout a never-ending stream would cost
    reader.join(5)
    assert not reader.is_alive()
