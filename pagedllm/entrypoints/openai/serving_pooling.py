"""Pooling models: ``POST /v1/embeddings``, ``/score`` and ``/rerank`` (also ``/v1/rerank``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from pagedllm.entrypoints.openai import protocol as P
from pagedllm.entrypoints.openai.common import JSONBodyRoute, unless_disconnected
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.state import ServerStateDep

router = APIRouter(route_class=JSONBodyRoute)


async def pool(
    llm: Any, prompts: list, truncate: int | None, raw: Request
) -> tuple[list[list[int]], list[list[float]]]:
    from pagedllm.pooling_params import PoolingParams

    outs = await unless_disconnected(llm.encode(prompts, PoolingParams(truncate_prompt_tokens=truncate)), raw)
    return [o.prompt_token_ids for o in outs], [o.outputs.embedding for o in outs]


@router.post("/v1/embeddings", response_model=None)
async def embeddings(req: P.EmbeddingRequest, state: ServerStateDep, raw: Request):
    llm = state.pooler()
    state.check_model(req.model)
    inp = req.input
    if isinstance(inp, str):
        prompts: list = [inp]
    elif inp and all(isinstance(x, int) for x in inp):
        prompts = [{"prompt_token_ids": inp}]
    else:
        prompts = [x if isinstance(x, str) else {"prompt_token_ids": x} for x in inp]
    if not prompts:
        raise APIError(400, "input is empty", "invalid_request_error", "input")
    size = llm.engine.hidden_size
    if req.dimensions is not None and req.dimensions != size:
        raise APIError(
            400,
            f"dimensions={req.dimensions}: this model's embeddings have {size} dimensions "
            "and it is not a Matryoshka model",
            "invalid_request_error",
            "dimensions",
        )
    ids, vectors = await pool(llm, prompts, req.truncate_prompt_tokens, raw)
    data = []
    for i, v in enumerate(vectors):
        if req.encoding_format == "base64":
            import base64

            import numpy as np

            emb: list[float] | str = base64.b64encode(np.asarray(v, dtype=np.float32).tobytes()).decode()
        else:
            emb = v
        data.append(P.EmbeddingData(index=i, embedding=emb))
    n = sum(map(len, ids))
    return P.EmbeddingResponse(
        id=P.random_id("embd"),
        model=req.model or state.served_model_name,
        data=data,
        usage=P.PoolingUsage(prompt_tokens=n, total_tokens=n),
    )


async def _similarities(
    llm: Any, text_1: str | list[str], text_2: str | list[str], truncate: int | None, raw: Request
) -> tuple[list[float], int]:
    from pagedllm.engine.pooling import pair_scores, score_texts

    ids, vectors = await pool(llm, score_texts(text_1, text_2), truncate, raw)
    return pair_scores(vectors), sum(map(len, ids))


@router.post("/score", response_model=None)
async def score(req: P.ScoreRequest, state: ServerStateDep, raw: Request):
    llm = state.pooler()
    state.check_model(req.model)
    scores, n = await _similarities(llm, req.text_1, req.text_2, req.truncate_prompt_tokens, raw)
    return P.ScoreResponse(
        id=P.random_id("score"),
        model=req.model or state.served_model_name,
        data=[P.ScoreData(index=i, score=s) for i, s in enumerate(scores)],
        usage=P.PoolingUsage(prompt_tokens=n, total_tokens=n),
    )


@router.post("/rerank", response_model=None)
@router.post("/v1/rerank", response_model=None)
async def rerank(req: P.RerankRequest, state: ServerStateDep, raw: Request):
    llm = state.pooler()
    state.check_model(req.model)
    scores, n = await _similarities(llm, req.query, req.documents, req.truncate_prompt_tokens, raw)
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or len(scores)]
    return P.RerankResponse(
        id=P.random_id("rerank"),
        model=req.model or state.served_model_name,
        usage=P.PoolingUsage(prompt_tokens=n, total_tokens=n),
        results=[
            P.RerankResult(index=i, document=P.RerankDocument(text=req.documents[i]), relevance_score=scores[i])
            for i in ranked
        ],
    )
