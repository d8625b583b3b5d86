"""LLMEngine: builds the pieces from an EngineConfig and drives them synchronously."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.errors import InvalidParameterError
from pagedllm.outputs import RequestOutput
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker import kv_cache
from pagedllm.worker.loader import load_model, resolve_device, resolve_dtype
from pagedllm.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from pagedllm.spec_decode.config import SpeculativeConfig

logger = logging.getLogger("pagedllm")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from pagedllm.model_loader import load_config, load_tokenizer, resolve_model

        t0 = time.perf_counter()
        self.config = config
        self.startup_stages: dict[str, float] = {}  # seconds per start-up stage, in order
        stage = functools.partial(_stage, self.startup_stages)
        mc, cc = config.model_config, config.cache_config
        self.source = resolve_model(mc.model)
        self.device = resolve_device(mc.device)
        if self.device.type == "cpu":
            from pagedllm import kernels

            kernels.build_in_background()  # the compiler runs while the config and tokenizer load
        logger.info("loading %s from %s", self.source.name, self.source.path)
        with stage("config"):
            self.hf_config = load_config(self.source)
        self.dtype = resolve_dtype(mc.dtype, self.hf_config, self.device)
        with stage("tokenizer"):
            self.tokenizer = load_tokenizer(self.source, mc.tokenizer)
        model = self._load_model()
        spec = config.speculative_config
        draft = None
        if spec is not None and spec.method != "ngram":
            with stage("draft_model"):
                draft = self._load_draft_model(spec, model)

        with stage("kv_cache"):
            self.kv_cache_dtype = kv_cache.resolve_kv_cache_dtype(cc.kv_cache_dtype, self.dtype)
            # a draft model's cache has as many blocks as the target's: both are indexed by one block table
            kv_models = [model] + ([draft] if spec is not None and spec.needs_draft_kv else [])
            per_block = sum(kv_cache.bytes_per_block(len(m.layers), cc.block_size, *m.kv_cache_shape_per_layer,
                                                     self.kv_cache_dtype) for m in kv_models)
            peak = self._profile_peak(model) if self.device.type == "cuda" else None
            num_blocks = kv_cache.num_blocks_for_budget(cc, self.device, per_block, peak)
            self.max_model_len = self._resolve_max_model_len(num_blocks)
            caches, draft_caches = self._allocate_caches(kv_models, num_blocks)
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s); max_model_len %d; max concurrency %.1fx",
                    num_blocks, cc.block_size, num_blocks * per_block / 2**30, self.kv_cache_dtype, self.max_model_len,
                    num_blocks * cc.block_size / self.max_model_len)
        self.num_blocks = num_blocks
        proposer = None
        if spec is not None:
            from pagedllm.spec_decode import build_proposer

            proposer = build_proposer(spec, draft, draft_caches, cc.block_size, self.device, model)
            logger.info("speculative decoding: %s, %d tokens per step", spec.method, spec.num_speculative_tokens)
        runner = ModelRunner(model, caches, cc.block_size, self.device, mc.seed,
                             processed_logprobs=mc.logprobs_mode == "processed_logprobs",
                             proposer=proposer, spec_config=spec, max_model_len=self.max_model_len)
        from pagedllm.structured_output import StructuredOutputManager

        so_cfg = config.structured_outputs_config
        eos = self._eos_token_ids()
        self.structured = StructuredOutputManager(  # the grammar library loads with the first constrained request
            self.tokenizer, self.hf_config.vocab_size, eos, so_cfg["backend"], float(so_cfg["compile_timeout"]))
        self.core = EngineCore(config, runner, num_blocks, self.max_model_len, self.structured)
        self.processor = Processor(self.tokenizer, self.hf_config.vocab_size, self.max_model_len,
                                   mc.max_logprobs, eos)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.startup_seconds = time.perf_counter() - t0
        logger.info("engine ready in %.1fs (%s)", self.startup_seconds,
                    ", ".join(f"{name} {sec:.1f}s" for name, sec in self.startup_stages.items()))

    def _load_model(self) -> torch.nn.Module:
        mc = self.config.model_config
        if self.device.type == "cpu":
            from pagedllm import kernels

            with _stage(self.startup_stages, "kernels"):  # waits for the background build, if still compiling
                kernels.try_load()
        return load_model(self.source, self.hf_config, self.dtype, self.device, mc.quantization,
                          stages=self.startup_stages)

    def _allocate_caches(self, models: list[torch.nn.Module], num_blocks: int) -> tuple[list, list]:
        bs = self.config.cache_config.block_size
        caches = [kv_cache.allocate_kv_caches(len(m.layers), num_blocks, bs, *m.kv_cache_shape_per_layer,
                                              self.kv_cache_dtype, self.device) for m in models]
        return caches[0], (caches[1] if len(caches) > 1 else [])

    def _load_draft_model(self, spec: "SpeculativeConfig", target: torch.nn.Module) -> torch.nn.Module:
        """The draft: another model with the target's vocabulary, or (no ``model``) the target's own weights;
        or a head (EAGLE, EAGLE-3, MEDUSA) that reads the target's hidden states."""
        from pagedllm.model_loader import load_config, resolve_model

        if spec.method != "draft_model":
            from pagedllm.models.spec_heads import load_spec_head

            logger.info("loading the %s head %s", spec.method, spec.model)
            head = load_spec_head(spec.method, spec.model, target, self.dtype, self.device)
            if spec.method == "medusa" and spec.num_speculative_tokens > head.num_heads:
                raise InvalidParameterError(
                    f"speculative_config.num_speculative_tokens: {spec.num_speculative_tokens} is more than the "
                    f"MEDUSA checkpoint's {head.num_heads} heads", "speculative_config.num_speculative_tokens")
            if spec.method == "eagle3":
                target.aux_hidden_state_layers = head.aux_hidden_state_layers(len(target.layers))
            return head

        source, hf_config = self.source, self.hf_config
        if spec.model:
            source = resolve_model(spec.model)
            hf_config = load_config(source)
            if hf_config.vocab_size != self.hf_config.vocab_size:
                raise InvalidParameterError(
                    f"speculative_config.model: the draft model's vocabulary ({hf_config.vocab_size} tokens) differs "
                    f"from the target's ({self.hf_config.vocab_size}); a draft must share the target's tokenizer",
                    "speculative_config.model")
        logger.info("loading the draft model %s%s", source.name,
                    f" ({spec.quantization})" if spec.quantization else "")
        return load_model(source, hf_config, self.dtype, self.device, spec.quantization)

    def _resolve_max_model_len(self, num_blocks: int) -> int:
        model_max = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        asked = self.config.model_config.max_model_len
        if asked is not None and asked > model_max:
            raise InvalidParameterError(
                f"max_model_len={asked} exceeds the model's max_position_embeddings ({model_max})", "max_model_len")
        capacity = num_blocks * self.config.cache_config.block_size
        if capacity < 2:
            raise InvalidParameterError(
                f"the KV cache has room for {capacity} tokens: raise kv_cache_memory or num_gpu_blocks_override",
                "kv_cache_memory")
        if asked is not None and asked > capacity:
            # a single request must always fit on its own, or preemption could never make progress
            raise InvalidParameterError(
                f"max_model_len={asked} is larger than the KV cache can hold ({capacity} tokens in "
                f"{num_blocks} blocks); lower max_model_len or give the cache more memory", "max_model_len")
        resolved = asked or min(model_max, capacity)
        if asked is None and capacity < model_max:
            logger.warning("max_model_len lowered to %d to fit the KV cache", resolved)
        return resolved

    def _profile_peak(self, model: torch.nn.Module) -> int:
        """CUDA: memory in use after the weights plus a worst-case activation pass (no KV cache yet)."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        n = self.config.scheduler_config.max_num_batched_tokens
        hidden = torch.zeros(n, model.config.hidden_size, dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            for layer in model.layers:  # the MLP is the activation peak; attention needs the cache
                layer.mlp(hidden)
            model.compute_logits(hidden[: self.config.scheduler_config.max_num_seqs])
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for src in (self.tokenizer.eos_token_id, getattr(self.hf_config, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(x) for x in src)
        if self.source.kind == "hf_dir":
            from transformers import GenerationConfig
            try:
                gen = GenerationConfig.from_pretrained(self.source.path).eos_token_id
            except OSError:  # no generation_config.json
                gen = None
            ids.update([gen] if isinstance(gen, int) else (gen or []))
        return frozenset(ids)

    # -- requests ---------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams,
                    priority: int = 0) -> str:
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.core.scheduler.requests or self.core.is_waiting_for_grammar(request_id):
            raise InvalidParameterError(f"request id {request_id!r} is already in use", "request_id")
        prepared = self.make_request(request_id, prompt, params, priority)
        self.add_prepared_request(prepared)
        return request_id

    def make_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                     priority: int = 0, group: str | None = None) -> "PreparedRequest":
        """Tokenize and validate, touching no engine state (safe from another thread).

        ``n`` > 1 becomes n child requests ``"{i}_{request_id}"``; child i samples with
        seed + i when a seed is given (vLLM's convention), so it reproduces the
        independent request with that seed. ``group`` names the user request it came with
        (the prompts of one batch share it): the FCFS queue serves groups in turn.
        """
        if not isinstance(params, SamplingParams):
            raise InvalidParameterError(f"expected SamplingParams, got {type(params).__name__}", "sampling_params")
        text, ids = self.processor.tokenize(prompt)
        ids = self.processor.truncate(ids, params)
        if params.structured_outputs is not None:
            self.structured.validate(params.structured_outputs)  # a bad schema / regex / grammar: 400 here
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidParameterError(f"priority must be an integer, got {priority!r}", "priority")
        if priority != 0 and self.config.scheduler_config.scheduling_policy != "priority":
            raise InvalidParameterError("priority needs scheduling_policy='priority'", "priority")
        children = []
        for i in range(params.n):
            child_params = _copy_params(params) if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            max_tokens = self.processor.check(ids, child_params)
            rid = request_id if params.n == 1 else f"{i}_{request_id}"
            children.append(Request(rid, ids, child_params, max_tokens, priority=priority,
                                    parent_id=request_id, index=i, group=group))
        children[0].pending_children = children[1:]
        return PreparedRequest(request_id, children, text)

    def add_prepared_request(self, prepared: "PreparedRequest") -> None:
        self.output_processor.add_request(prepared.request_id, prepared.children, prepared.prompt)
        self.core.add_request(prepared.children[0])

    def abort_request(self, request_ids: list[str]) -> None:
        self.core.abort_requests([c for rid in request_ids for c in self.output_processor.child_ids(rid)])

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs, to_stop = self.output_processor.process(self.core.step())
        for rid, stop in to_stop:
            self.core.finish_request(rid, stop)
        return outputs

    def get_num_unfinished_requests(self) -> int:
        s = self.core.scheduler
        return len(s.running) + len(s.waiting) + self.core.num_waiting_for_grammar()


@contextlib.contextmanager
def _stage(stages: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    stages[name] = stages.get(name, 0.0) + time.perf_counter() - t0


@dataclasses.dataclass(slots=True)
class PreparedRequest:
    request_id: str
    children: list[Request]  # one per completion (n); the first computes the prompt
    prompt: str | None


def _copy_params(params: SamplingParams) -> SamplingParams:
    """Each request gets its own copy: bind_eos must not leak into a params object shared by a batch."""
    import copy

    return copy.copy(params)

