"""Pooling: sentence embeddings and scores (``LLM(runner="pooling")``) from encoder models (BERT), and from
Llama-family decoders (last-token pooling). The types and the math; the engine is the generating one.

Pooling is a runner mode of the same engine: a pooling request goes through the Processor, the
scheduler (whole prompt in one step, under ``max_num_batched_tokens`` and ``max_num_seqs``, batched
with the other pooling requests), the executor and the ModelRunner, which pools each request's hidden
states instead of sampling; the request finishes in that step and its KV blocks (a decoder's, which
it writes during its pass; an encoder gets none) are freed at once, never kept for prefix caching.
Pooling follows the model's sentence-transformers files (``modules.json``: mean, CLS or last-token
pooling from ``1_Pooling/config.json``, and a ``Normalize`` module), or CLS (encoders) / the last token
(decoders) + normalisation where the directory has none.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pagedllm.errors import InvalidParameterError

if TYPE_CHECKING:
    import torch

    from pagedllm.config import EngineConfig
    from pagedllm.outputs import RequestMetrics


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    pooling: Literal["mean", "cls", "last"] = "cls"
    normalize: bool = True
    max_seq_length: int | None = None


def read_pooling_config(model_dir: str, decoder: bool = False) -> PoolingConfig:
    """Pooling as the directory's sentence-transformers configuration says; without one, CLS for an
    encoder and the last token for a decoder (the only one that has seen the whole text), normalised."""
    root = Path(model_dir)
    if root.is_file() or not (root / "modules.json").exists():
        return PoolingConfig("last") if decoder else PoolingConfig()
    modules = json.loads((root / "modules.json").read_text())
    pooling: Literal["mean", "cls", "last"] = "cls"
    normalize = False
    for m in modules:
        kind = m.get("type", "")
        if kind.endswith("Pooling"):
            cfg = json.loads((root / m.get("path", "") / "config.json").read_text())
            if cfg.get("pooling_mode_mean_tokens"):
                pooling = "mean"
            elif cfg.get("pooling_mode_lasttoken"):
                pooling = "last"
            elif cfg.get("pooling_mode_cls_token"):
                pooling = "cls"
            else:
                raise InvalidParameterError(f"unsupported sentence-transformers pooling {cfg}", "model")
        elif kind.endswith("Normalize"):
            normalize = True
        elif not kind.endswith("Transformer"):
            raise InvalidParameterError(f"unsupported sentence-transformers module {kind!r}", "model")
    max_len = None
    st = root / "sentence_bert_config.json"
    if st.exists():
        max_len = json.loads(st.read_text()).get("max_seq_length")
    return PoolingConfig(pooling, normalize, max_len)


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """vLLM's shape: ``outputs.embedding`` (``outputs`` is None for a request aborted before its step)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None
    finished: bool = True
    metrics: RequestMetrics | None = None
    prompt: str | None = None
    num_cached_tokens: int = 0  # never any: pooling requests skip the prefix cache


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


def score_texts(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[str]:
    """What to embed to score ``text_1`` against ``text_2`` (one text against each, or pairwise): the n left
    sides, then the n right sides; :func:`pair_scores` turns their vectors into the n scores."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if len(first) == 1:
        first = first * len(second)
    if not second or len(first) != len(second):
        raise InvalidParameterError(
            f"give one text_1 or as many as text_2; got {len(first)} and {len(second)}", "text_1"
        )
    return first + second


def pair_scores(vectors: list[torch.Tensor] | list[list[float]]) -> list[float]:
    """The cosine similarity of each left vector with its right one (as vLLM scores with embedding models)."""
    import torch

    v = torch.stack([torch.as_tensor(x, dtype=torch.float32) for x in vectors])
    n = len(vectors) // 2
    return torch.nn.functional.cosine_similarity(v[:n], v[n:], dim=-1).tolist()


def pool_hidden_states(hidden: torch.Tensor, seq_lens: list[int], pooling: str, normalize: list[bool]) -> torch.Tensor:
    """One vector per sequence of a flattened batch ``hidden`` [T, H] (sequences back to back, ``seq_lens``
    tokens each): its first token's (CLS), its last token's, or the mean of its tokens; each row
    L2-normalised where ``normalize`` says so. Float32."""
    import torch

    hidden = hidden.float()
    dev = hidden.device
    lens = torch.tensor(seq_lens, device=dev)
    ends = lens.cumsum(0)
    if pooling == "cls":
        pooled = hidden[ends - lens]
    elif pooling == "last":
        pooled = hidden[ends - 1]
    else:
        seg = torch.arange(len(seq_lens), device=dev).repeat_interleave(lens)
        pooled = torch.zeros(len(seq_lens), hidden.shape[1], device=dev).index_add_(0, seg, hidden)
        pooled /= lens.to(pooled.dtype)[:, None]
    if all(normalize):
        return torch.nn.functional.normalize(pooled, dim=-1)
    if any(normalize):
        rows = torch.tensor(normalize, device=dev)
        pooled[rows] = torch.nn.functional.normalize(pooled[rows], dim=-1)
    return pooled


def pooling_architectures() -> list[str]:
    return ["BertModel"]


def pooling_mode(config: EngineConfig, model_cls: type, architectures: Any = None) -> bool:
    """Whether the engine runs the pooling runner: ``runner='pooling'``, or 'auto' on an encoder model.
    Refuses what pooling cannot run on (a decoder outside the Llama family) and an encoder asked to generate."""
    from pagedllm.models.llama import LlamaForCausalLM

    runner = config.model_config.runner
    encoder = bool(getattr(model_cls, "is_pooling_model", False))
    if runner == "generate" and encoder:
        raise InvalidParameterError(
            f"{model_cls.__name__} is an encoder: it computes embeddings only "
            "(runner='pooling' or 'auto'), it cannot generate text",
            "runner",
        )
    pooling = runner == "pooling" or (runner == "auto" and encoder)
    if pooling and not encoder and not issubclass(model_cls, LlamaForCausalLM):
        raise InvalidParameterError(
            f"runner='pooling' runs encoder models ({', '.join(pooling_architectures())}) and Llama-family "
            f"decoders; {architectures} is neither",
            "runner",
        )
    return pooling
