"""The start-up warm-up (pagedllm/engine/warmup.py): it runs before the engine is ready and leaves no trace.

No timings here: what the warm-up buys (a first request as fast as the second) is measured by hand, on an
idle machine; these tests check that an engine after its warm-up is the engine it was before."""

from __future__ import annotations

import threading
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine import llm_engine
from pagedllm.engine.warmup import WARMUP_REQUEST_ID

KW = dict(num_gpu_blocks_override=64, max_model_len=128)
PROMPTS = ["The quick brown fox", "Once upon a time", "def add(a, b):"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


def _no_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llm_engine, "warm_up", lambda engine, core: None)


def _assert_untouched(llm: LLM) -> None:
    engine = llm.llm_engine
    core, pool = engine.core, engine.core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.block_hash is None for b in pool.blocks) and not pool.cached
    assert not core.scheduler.requests and not core.step_history
    stats = core.make_stats()
    assert (stats.prefix_cache.queries, stats.prefix_cache.hits, stats.num_preemptions) == (0, 0, 0)
    core.scheduler.check_invariants()
    assert not core.runner.states  # the workers were told the warm-up's requests finished
    assert not engine.output_processor.parents and not engine.output_processor.children


def test_warmup_is_a_startup_stage_and_leaves_no_blocks_requests_or_stats(model_dir):
    llm = LLM(model_dir, **KW)
    assert "warmup" in llm.llm_engine.startup_stages
    _assert_untouched(llm)


def test_outputs_are_those_of_an_engine_without_warmup(model_dir, monkeypatch):
    """Greedy tokens and logprobs, seeded samples, and unseeded ones (their streams come from the request
    ids, numbered from 0 as before: the warm-up takes none of them) are the same."""
    greedy = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    unseeded = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)

    def run(llm: LLM) -> list:
        outs = [llm.generate(PROMPTS, p, use_tqdm=False) for p in (greedy, seeded, unseeded)]
        return [
            (o.request_id, c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs or []])
            for batch in outs
            for o in batch
            for c in o.outputs
        ]

    warmed = run(LLM(model_dir, **KW))
    _no_warmup(monkeypatch)
    cold = LLM(model_dir, **KW)
    assert "warmup" in cold.llm_engine.startup_stages  # the stage is timed, empty
    assert run(cold) == warmed
    assert all(not rid.startswith(WARMUP_REQUEST_ID) for rid, *_ in warmed)


def test_pooling_model_warms_up_and_embeds_as_without_warmup(model_dir, monkeypatch):
    warmed = LLM(model_dir, runner="pooling", **KW)
    _assert_untouched(warmed)
    got = [o.outputs.embedding for o in warmed.embed(PROMPTS)]
    _no_warmup(monkeypatch)
    assert [o.outputs.embedding for o in LLM(model_dir, runner="pooling", **KW).embed(PROMPTS)] == got


def test_a_fresh_server_counts_no_request_and_shows_none(model_dir):
    """/metrics and /v1/engine/state of a server that has served nothing: the warm-up ran through the same
    engine and left no count, token, prefix-cache query, step or request behind."""
    from fastapi.testclient import TestClient

    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.openai.server import build_app

    app = build_app(lambda: LLMEngine(EngineConfig.from_kwargs(model=model_dir, **KW)), "m")
    with TestClient(app) as client:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine did not load"
            time.sleep(0.05)
        state = client.get("/v1/engine/state", params={"check": "true"}).json()
        assert state["invariants"] == "ok"
        assert state["running"] == state["waiting"] == state["steps"] == []
        assert state["blocks"]["used"] == state["blocks"]["cached"] == 0
        assert all(v == 0 for v in state["totals"].values()), state["totals"]
        counted: dict[str, float] = {}  # each counter summed over its labels
        for line in client.get("/metrics").text.splitlines():
            if line.startswith("pagedllm:") and "_total{" in line:
                name = line.split("{")[0]
                counted[name] = counted.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        for name in (
            "pagedllm:request_success_total",
            "pagedllm:prompt_tokens_total",
            "pagedllm:generation_tokens_total",
            "pagedllm:prefix_cache_queries_total",
            "pagedllm:prefix_cache_hits_total",
        ):
            assert counted[name] == 0, name
        first = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert first.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("enabled", [True, False])
def test_startup_pauses_the_garbage_collector_and_leaves_it_as_it_was(model_dir, monkeypatch, enabled):
    """The collector is off while the engine starts (its automatic passes over the start-up's objects cost a
    1.5B GGUF 2 s of 4.4), one collection is a stage of its own, and the collector ends as it began: after a
    start and after a start that fails."""
    import gc

    seen: list[bool] = []
    real = llm_engine.warm_up

    def spy(engine, core):
        seen.append(gc.isenabled())
        real(engine, core)

    monkeypatch.setattr(llm_engine, "warm_up", spy)
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        llm = LLM(model_dir, **KW)
        assert seen == [False] and gc.isenabled() is enabled
        assert list(llm.llm_engine.startup_stages)[-1] == "gc"
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            LLM(model_dir, enable_chunked_prefill=False, max_num_batched_tokens=64, **KW)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def _load_model_spy(monkeypatch: pytest.MonkeyPatch, loading: threading.Event, shutdowns: list[str]) -> None:
    """Sets ``loading`` when the executor starts loading the weights; notes each executor shutdown."""
    import pagedllm.executor as executor

    real = executor.make_executor

    def make(*args, **kwargs):
        ex = real(*args, **kwargs)
        load, shutdown = ex.load_model, ex.shutdown

        def spied_load():
            loading.set()
            return load()

        def spied_shutdown():
            shutdowns.append("shutdown")
            return shutdown()

        ex.load_model, ex.shutdown = spied_load, spied_shutdown
        return ex

    monkeypatch.setattr(executor, "make_executor", make)


def test_the_tokenizer_loads_on_a_thread_beside_the_weights(model_dir, monkeypatch):
    """The tokenizer's load (about a second on a 151k vocabulary) overlaps the weights' loading: a tokenizer
    that waits until the weights have begun to load would wait forever if it loaded before them, as it did."""
    import pagedllm.model_loader as model_loader

    loading, shutdowns, seen = threading.Event(), [], {}
    _load_model_spy(monkeypatch, loading, shutdowns)
    real = model_loader.load_tokenizer

    def waiting_tokenizer(*args):
        seen["thread"] = threading.current_thread().name
        seen["weights began first"] = loading.wait(timeout=30)
        return real(*args)

    monkeypatch.setattr(model_loader, "load_tokenizer", waiting_tokenizer)
    llm = LLM(model_dir, **KW)
    assert seen == {"thread": "pagedllm-tokenizer", "weights began first": True}
    out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert out[0].outputs[0].text and out[0].prompt_token_ids == llm.get_tokenizer()("The quick brown fox").input_ids
    assert "tokenizer" in llm.llm_engine.startup_stages and not shutdowns


def test_a_tokenizer_that_fails_to_load_fails_the_start_and_stops_the_executor(model_dir, monkeypatch):
    """Its error reaches the caller as it was raised, after the weights loaded beside it, and the executor that
    holds them is shut down."""
    import pagedllm.model_loader as model_loader

    loading, shutdowns = threading.Event(), []
    _load_model_spy(monkeypatch, loading, shutdowns)

    def broken(*args):
        raise OSError("tokenizer file unreadable")

    monkeypatch.setattr(model_loader, "load_tokenizer", broken)
    with pytest.raises(OSError, match="tokenizer file unreadable"):
        LLM(model_dir, **KW)
    assert loading.is_set() and shutdowns == ["shutdown"]


@pytest.mark.parametrize("failure", ["tokenizer", "budget"])
def test_a_start_that_fails_frees_the_weights_while_its_error_is_held(model_dir, monkeypatch, failure):
    """The error's traceback holds the half-built engine (a REPL keeps it as sys.last_value): its executor lets
    go of the worker, so the weights and KV cache are not held with it. On CUDA a second engine in the process
    found no memory for its cache after such a start."""
    import gc
    import traceback
    import weakref

    import pagedllm.model_loader as model_loader
    from pagedllm.errors import EngineDeadError
    from pagedllm.worker.worker import Worker

    models: list[weakref.ref] = []
    real_load = Worker.load_model

    def load(self):
        out = real_load(self)
        models.append(weakref.ref(self.model))
        return out

    monkeypatch.setattr(Worker, "load_model", load)
    kw = dict(KW)
    if failure == "tokenizer":
        monkeypatch.setattr(model_loader, "load_tokenizer", lambda *a: (_ for _ in ()).throw(OSError("unreadable")))
    else:
        kw.update(enable_chunked_prefill=False, max_num_batched_tokens=64)
    with pytest.raises((OSError, ValueError)) as e:
        LLM(model_dir, **kw)
    gc.collect()
    assert len(models) == 1 and models[0]() is None, "the failed start's model is still alive"
    frames = [frame for frame, _ in traceback.walk_tb(e.value.__traceback__)]
    engine = next(f.f_locals["self"] for f in frames if isinstance(f.f_locals.get("self"), llm_engine.LLMEngine))
    with pytest.raises(EngineDeadError, match="shut down"):
        engine.executor.worker  # noqa: B018 (the access is what is tested)
