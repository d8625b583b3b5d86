"""The pooling runner: sentence embeddings and scores (``LLM(runner="pooling")``) from encoder models, and from
Llama-family decoders (last-token pooling: :class:`DecoderPooler`).

A pooling request is one forward pass and keeps no KV cache, so it needs none of the
generating engine's paging or sampling. What it shares with it is the batch: every
sequence's tokens back to back in one flattened batch under ``max_num_batched_tokens``.
Sequences are sorted by length before they are cut into batches, so the one padded step
inside attention wastes little. Pooling follows the model's sentence-transformers files
(``modules.json``: mean, CLS or last-token pooling from ``1_Pooling/config.json``, and a
``Normalize`` module), or CLS (encoders) / the last token (decoders) + normalisation where the
directory has none.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from pagedllm.config import EngineConfig
from pagedllm.errors import InvalidParameterError

logger = logging.getLogger("pagedllm")


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
    pooling, normalize = "cls", False
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
    """vLLM's shape: ``outputs.embedding``."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


def score_texts(text_1: str | list[str], text_2: str | list[str]) -> list[str]:
    """What to embed to score ``text_1`` against ``text_2`` (one text against each, or pairwise): the n left
    sides, then the n right sides; :func:`pair_scores` turns their vectors into the n scores."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if len(first) == 1:
        first = first * len(second)
    if not second or len(first) != len(second):
        raise InvalidParameterError(f"give one text_1 or as many as text_2; got {len(first)} and {len(second)}",
                                    "text_1")
    return first + second


def pair_scores(vectors: list[torch.Tensor]) -> list[float]:
    """The cosine similarity of each left vector with its right one (as vLLM scores with embedding models)."""
    n = len(vectors) // 2
    return torch.nn.functional.cosine_similarity(torch.stack(vectors[:n]), torch.stack(vectors[n:]), dim=-1).tolist()


class PoolingEngine:
    def __init__(self, config: EngineConfig):
        from pagedllm.model_loader import load_config, load_tokenizer, resolve_model
        from pagedllm.models.registry import ModelRegistry
        from pagedllm.worker.loader import load_model, resolve_device, resolve_dtype

        t0 = time.perf_counter()
        self.config = config
        mc = config.model_config
        self.source = resolve_model(mc.model)
        self.device = resolve_device(mc.device)
        self.hf_config = load_config(self.source)
        from pagedllm.models.llama import LlamaForCausalLM

        model_cls = ModelRegistry.resolve_for_config(self.hf_config)
        decoder = not getattr(model_cls, "is_pooling_model", False)
        if decoder and not issubclass(model_cls, LlamaForCausalLM):
            raise InvalidParameterError(
                f"runner='pooling' runs encoder models ({', '.join(pooling_architectures())}) and Llama-family "
                f"decoders; {getattr(self.hf_config, 'architectures', None)} is neither", "runner")
        if config.parallel_config.world_size > 1:
            raise InvalidParameterError("pooling models run in one process: tensor / pipeline parallelism "
                                        "is not supported for them", "tensor_parallel_size")
        if config.cache_config.kv_offloading_size is not None or config.kv_transfer_config is not None:
            raise InvalidParameterError("pooling models keep no KV cache: kv_offloading_size and "
                                        "kv_transfer_config do not apply to them", "kv_offloading_size")
        self.dtype = resolve_dtype(mc.dtype, self.hf_config, self.device)
        self.tokenizer = load_tokenizer(self.source, mc.tokenizer)
        self.model = load_model(self.source, self.hf_config, self.dtype, self.device, mc.quantization)
        if decoder:
            self.model = DecoderPooler(self.model)
        self.pooling = read_pooling_config(self.source.path, decoder)
        limits = [mc.max_model_len, self.pooling.max_seq_length, self.hf_config.max_position_embeddings]
        self.max_model_len = min(x for x in limits if x)
        # the generating engine's token budget (measured on all-MiniLM-L6-v2 here: 1,000 sentences took 7.0 s
        # in batches of 512 tokens, 7.6 s of 2,048 and 8.7 s of 8,192: smaller GEMMs stay in cache)
        self.max_num_batched_tokens = max(config.scheduler_config.max_num_batched_tokens, self.max_model_len)
        self.num_tokens_computed = 0
        logger.info("pooling engine ready in %.1fs (%s pooling%s, max_model_len %d)", time.perf_counter() - t0,
                    self.pooling.pooling, ", normalized" if self.pooling.normalize else "", self.max_model_len)

    @property
    def hidden_size(self) -> int:
        return self.hf_config.hidden_size

    def tokenize_many(self, prompts: list[Any], truncate: int | None = None) -> list[list[int]]:
        """``tokenize`` for a list, the texts through the tokenizer in one batch call."""
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(self.tokenizer(texts)["input_ids"] if texts else [])
        return [self._checked(next(encoded) if isinstance(p, str) else self._given_ids(p), truncate)
                for p in prompts]

    def tokenize(self, prompt: Any, truncate: int | None = None) -> list[int]:
        """Token ids of a prompt (text, or ``{"prompt_token_ids": [...]}``), with the model's special tokens."""
        return self.tokenize_many([prompt], truncate)[0]

    def _given_ids(self, prompt: Any) -> list[int]:
        if not (isinstance(prompt, dict) and "prompt_token_ids" in prompt):
            raise InvalidParameterError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got "
                                        f"{type(prompt).__name__}", "prompt")
        ids = list(prompt["prompt_token_ids"])
        vocab = self.hf_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidParameterError(f"token ids must be integers in [0, {vocab})", "prompt_token_ids")
        return ids

    def _checked(self, ids: list[int], truncate: int | None) -> list[int]:
        """``ids`` cut to ``truncate`` (keeping the final special token), refused when empty or too long."""
        if truncate is not None and len(ids) > truncate:
            ids = ids[:truncate - 1] + ids[-1:] if truncate > 1 else ids[:truncate]  # keep the final [SEP]
        if not ids:
            raise InvalidParameterError("the prompt is empty", "prompt")
        if len(ids) > self.max_model_len:
            raise InvalidParameterError(f"the prompt has {len(ids)} tokens, more than this model's "
                                        f"{self.max_model_len}", "prompt")
        return ids

    @torch.inference_mode()
    def embed_ids(self, batch: list[list[int]]) -> list[torch.Tensor]:
        """One pooled (and, per the model, normalised) float32 vector per sequence, in input order."""
        order = sorted(range(len(batch)), key=lambda i: len(batch[i]))
        out: list[torch.Tensor | None] = [None] * len(batch)
        group: list[int] = []
        tokens = 0
        for i in order + [-1]:
            if i >= 0 and tokens + len(batch[i]) <= self.max_num_batched_tokens:
                group.append(i)
                tokens += len(batch[i])
                continue
            if group:
                for j, v in zip(group, self._forward([batch[j] for j in group])):
                    out[j] = v
            group, tokens = ([i], len(batch[i])) if i >= 0 else ([], 0)
        return out  # type: ignore[return-value]

    def _forward(self, seqs: list[list[int]]) -> torch.Tensor:
        dev = self.device
        lens = [len(s) for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s], device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        hidden = self.model(ids, positions, lens).float()
        self.num_tokens_computed += len(ids)
        ends = torch.tensor(lens, device=dev).cumsum(0)
        if self.pooling.pooling == "cls":
            pooled = hidden[ends - torch.tensor(lens, device=dev)]
        elif self.pooling.pooling == "last":
            pooled = hidden[ends - 1]
        else:
            seg = torch.arange(len(seqs), device=dev).repeat_interleave(torch.tensor(lens, device=dev))
            pooled = torch.zeros(len(seqs), hidden.shape[1], device=dev).index_add_(0, seg, hidden)
            pooled /= torch.tensor(lens, device=dev, dtype=pooled.dtype)[:, None]
        if self.pooling.normalize:
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return pooled


class DecoderPooler(torch.nn.Module):
    """A Llama-family model as an embedding model: each sequence in one causal pass, nothing kept.

    Every sequence is a whole-prompt prefill, which attends to its own fresh K/V; the attention
    backend still writes K/V to its cache, so each layer gets a one-block scratch cache that every
    token writes over and nothing reads. Returns the final norm's hidden states [T, hidden].
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        a = model.layers[0].self_attn
        w = next(model.parameters())
        self.scratch = [torch.zeros(2, 1, 16, a.num_kv_heads, a.head_dim, dtype=w.dtype, device=w.device)
                        for _ in model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        from pagedllm.attention import AttentionMetadata

        dev = input_ids.device
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(len(input_ids), dtype=torch.long, device=dev),
            block_tables=torch.zeros(len(seq_lens), 1, dtype=torch.long, device=dev),
            seq_lens=torch.tensor(seq_lens, device=dev), num_decodes=0, query_start_loc=starts,
            seq_lens_cpu=list(seq_lens), block_size=16)
        return self.model(input_ids, positions, self.scratch, meta)


def pooling_architectures() -> list[str]:
    return ["BertModel"]


def is_pooling_config(config: EngineConfig) -> bool:
    """Whether ``runner`` (or, for 'auto', the model's architecture) asks for the pooling runner."""
    runner = config.model_config.runner
    if runner != "auto":
        return runner == "pooling"
    from pagedllm.model_loader import load_config, resolve_model
    from pagedllm.models.registry import ModelRegistry

    hf = load_config(resolve_model(config.model_config.model))
    return bool(getattr(ModelRegistry.resolve_for_config(hf), "is_pooling_model", False))


class AsyncPooler:
    """The server's handle on a PoolingEngine: requests from the event loop are queued to one thread, which
    takes everything waiting (up to the token budget) into each forward, so concurrent requests share
    batches. ``max_queue_len`` bounds the sequences waiting; beyond it a request fails at once."""

    def __init__(self, engine: PoolingEngine, max_queue_len: int | None = None):
        import queue
        import threading

        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_queue_len = max_queue_len
        self.dead: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0  # sequences queued, not yet computed
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="pagedllm-pooler", daemon=True)
        self._thread.start()

    async def prepare(self, fn: Any, *args: Any) -> Any:
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def embed(self, ids: list[list[int]]) -> list[torch.Tensor]:
        import asyncio
        import concurrent.futures

        from pagedllm.engine.async_llm import QueueFullError

        if self.dead is not None:
            from pagedllm.errors import EngineDeadError

            raise EngineDeadError(f"the pooling engine died: {self.dead}")
        with self._lock:
            if self.max_queue_len is not None and self._pending + len(ids) > self.max_queue_len:
                raise QueueFullError(f"{self._pending} sequences are waiting; {len(ids)} more would pass "
                                     f"max_queue_len={self.max_queue_len}", "input")
            self._pending += len(ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((ids, fut))
        return await asyncio.wrap_future(fut)

    def _loop(self) -> None:
        import queue

        while True:
            item = self._queue.get()
            if item is None:
                return
            items, tokens = [item], sum(map(len, item[0]))
            while tokens < self.engine.max_num_batched_tokens:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                items.append(nxt)
                tokens += sum(map(len, nxt[0]))
            live = [(ids, fut) for ids, fut in items if fut.set_running_or_notify_cancel()]
            try:
                vectors = self.engine.embed_ids([s for ids, _ in live for s in ids]) if live else []
            except BaseException as e:  # noqa: BLE001 -- the requests fail; the thread keeps serving
                for _, fut in live:
                    fut.set_exception(e)
            else:
                start = 0
                for ids, fut in live:
                    fut.set_result(vectors[start:start + len(ids)])
                    start += len(ids)
            finally:
                with self._lock:
                    self._pending -= sum(len(ids) for ids, _ in items)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
