"""Worker: one rank of the engine. Its shard of the model, its KV cache and a ModelRunner.

The uniproc executor holds one in the engine's own process; the mp and ray
executors run one per process, each joined to the others by torch.distributed.
Every rank runs every step (the same SchedulerOutput); the driver rank (the
last pipeline stage's first TP rank) samples and its output is the step's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from pagedllm.attention import kv_int8
from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.distributed import ParallelState, init_distributed
from pagedllm.errors import InvalidParameterError
from pagedllm.worker import kv_cache
from pagedllm.worker.cpu_share import CpuShare, usable_cores
from pagedllm.worker.loader import keep_activations_in_heap, load_model, resolve_device, resolve_dtype, timed_stage
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.runner_output import ModelRunnerOutput

if TYPE_CHECKING:
    from pagedllm.kv_transfer.mooncake import MooncakeWorker
    from pagedllm.kv_transfer.offload import OffloadWorker
    from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM
    from pagedllm.models.spec_heads import EagleHead, MedusaHead
    from pagedllm.spec_decode.config import SpeculativeConfig

logger = logging.getLogger("pagedllm")


class _DecoderLayer(Protocol):
    """What the worker reads of a decoder layer (LlamaDecoderLayer, Gemma3DecoderLayer, ...)."""

    self_attn: LlamaAttention
    mlp: torch.nn.Module


def _layers(model: LlamaForCausalLM) -> Sequence[_DecoderLayer]:
    return cast("Sequence[_DecoderLayer]", model.layers)  # an nn.ModuleList types its items as nn.Module


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        init_method: str | None = None,
        num_threads: int | None = None,
        source: Any = None,
        hf_config: Any = None,
        stages: dict[str, float] | None = None,
        lora_cache: Any = None,
    ):
        from pagedllm.model_loader import load_config, resolve_model

        self.config = config
        mc, pc = config.model_config, config.parallel_config
        self.device = resolve_device(mc.device)
        threads = mc.cpu_threads or num_threads
        if not threads and self.device.type == "cpu":
            threads = min(torch.get_num_threads(), usable_cores())  # a container's quota bounds it too
        if threads:
            torch.set_num_threads(threads)
        # a CPU worker gives up threads while other processes hold its cores (cpu_share.py says why)
        self.num_threads = torch.get_num_threads()
        self.cpu_share = CpuShare(self.num_threads) if self.device.type == "cpu" and mc.cpu_threads is None else None
        self._threads = 0  # the count set in the thread that runs the steps (0: none set there yet)
        self.source = source or resolve_model(mc.model)
        self.hf_config = hf_config or load_config(self.source)
        self.dtype = resolve_dtype(mc.dtype, self.hf_config, self.device)
        self.stages = stages if stages is not None else {}
        tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        if tp * pp == 1:
            self.ps = ParallelState()
        else:
            assert init_method is not None, "the executor gives every rank of a group its rendezvous address"
            self.ps = init_distributed(tp, pp, rank, init_method, self.device)
        self.ps.expert_parallel = pc.enable_expert_parallel
        self.model: torch.nn.Module | None = None
        self.draft: torch.nn.Module | None = None
        self.runner: ModelRunner | None = None
        self.lora_cache = lora_cache  # the engine's AdapterCache (LoRA runs in one process)
        from pagedllm.engine.pooling import pooling_mode, read_pooling_config
        from pagedllm.models.registry import ModelRegistry

        # a pooling runner: how it pools (None: it generates); an encoder has no KV cache at all
        model_cls = ModelRegistry.resolve_for_config(self.hf_config)
        self.pooling = (
            read_pooling_config(self.source.path, decoder=not getattr(model_cls, "is_pooling_model", False))
            if pooling_mode(config, model_cls)
            else None
        )
        self.encoder = bool(getattr(model_cls, "is_pooling_model", False))

    @property
    def _lm(self) -> LlamaForCausalLM:
        """The loaded model as a generating one: each is built as LlamaForCausalLM is (its layers, KV geometry,
        logits); the registry only knows it as a class."""
        assert self.model is not None, "load_model() first"
        return cast("LlamaForCausalLM", self.model)

    def load_model(self) -> tuple[int, dict[str, float]]:
        """Load this rank's weights; returns how many KV blocks its memory budget allows, and the
        seconds of each loading stage."""
        mc, cc = self.config.model_config, self.config.cache_config
        if self.device.type == "cpu":
            from pagedllm import kernels

            with timed_stage(self.stages, "kernels"):
                kernels.try_load()  # waits for a background build, if one is still compiling
        # on CUDA, what the process held before this engine loaded (another engine's weights and cache) is not
        # this engine's: gpu_memory_utilization is a limit per engine, as in vLLM
        held_before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.model = load_model(
            self.source, self.hf_config, self.dtype, self.device, mc.quantization, stages=self.stages, parallel=self.ps
        )
        if self.device.type == "cpu":
            # a step's large activations are not mapped and faulted in anew each time; set once the weights are
            # in, so that what loading frees (a tensor's copies before its layout) goes back at once, not to a heap
            # that keeps up to 1 GiB of it (the 1.5B BF16: 0.4 GiB of peak RSS)
            keep_activations_in_heap()
        if self.encoder:
            return 0, self.stages  # no KV cache: attention sees only the sequence itself
        lm = self._lm
        self._fuse_decode(lm)
        spec = self.config.speculative_config
        if spec is not None and spec.method != "ngram":
            with timed_stage(self.stages, "draft_model"):
                self.draft = self._load_draft_model(spec, lm)
            self._fuse_decode(self.draft)  # a draft model's one-token passes are decode steps too
        with timed_stage(self.stages, "kv_cache"):
            self.kv_cache_dtype = kv_cache.resolve_kv_cache_dtype(cc.kv_cache_dtype, self.dtype)
            self.per_block = sum(
                kv_cache.bytes_per_block(len(m.layers), cc.block_size, *m.kv_cache_shape_per_layer, self.kv_cache_dtype)
                for m in self._kv_models()
            )
            peak = self._profile_peak(lm) - held_before if self.device.type == "cuda" else None
            # what max_num_seqs requests of max_model_len tokens fill, a block more each for a partial last one
            max_len = mc.max_model_len or getattr(self.hf_config, "max_position_embeddings", None) or 2048
            wanted = self.config.scheduler_config.max_num_seqs * (-(-max_len // cc.block_size) + 1)
            num_blocks = kv_cache.num_blocks_for_budget(cc, self.device, self.per_block, peak, wanted)
        return num_blocks, self.stages

    def _fuse_decode(self, model: torch.nn.Module) -> None:
        """On CPU, unless enforce_eager: a Llama-family model's decode steps run their layer loop in C."""
        if self.device.type == "cpu" and not self.config.model_config.enforce_eager and hasattr(model, "fused_decode"):
            from pagedllm.models.fused_decode import FusedDecode

            cast("LlamaForCausalLM", model).fused_decode = FusedDecode(model)

    def _kv_models(self) -> list[LlamaForCausalLM]:
        # a draft model's cache has as many blocks as the target's: both are indexed by one block table
        spec = self.config.speculative_config
        if spec is None or not spec.needs_draft_kv:
            return [self._lm]
        return [self._lm, cast("LlamaForCausalLM", self.draft)]  # a draft model, or an EAGLE head (one such)

    def kv_block_layout(self) -> tuple[torch.Size, torch.dtype]:
        """Shape and dtype of one KV block on this rank: [layers, 2, block_size, kv heads, head dim (int8: its
        rows' width, with their scales)]."""
        m = self._lm
        kvh, d = m.kv_cache_shape_per_layer
        row = kv_int8.row_width(d, self.kv_cache_dtype)
        return torch.Size([len(m.layers), 2, self.config.cache_config.block_size, kvh, row]), self.kv_cache_dtype

    def kv_connector_info(self) -> dict | None:
        """Where the KV connector's worker half can be reached (MooncakeConnector: its transfer engine)."""
        assert self.runner is not None, "init_cache() first"
        info = getattr(self.runner.kv_connector, "info", None)
        return info() if info is not None else None

    def layer_windows(self) -> list[int | None]:
        """Each of this rank's layers' sliding window (None: full attention)."""
        return [layer.self_attn.sliding_window for layer in _layers(self._lm)]

    def init_cache(
        self,
        num_blocks: int,
        max_model_len: int,
        num_offload_slots: int = 0,
        connector: tuple | None = None,
        kv_groups: Any = None,
    ) -> None:
        """Allocate the KV cache (``num_blocks``, the smallest any rank allows) and, with an offload tier, its
        RAM pool of ``num_offload_slots`` blocks, and the KV connector's worker half (``connector``: ``("disk",
        path, model fingerprint)`` or ``("mooncake", MooncakeOptions)``); build the
        runner. With ``kv_groups`` (:class:`~pagedllm.core.kv_groups.KVGroups`) a block holds one group's layers:
        a cache tensor per slot, shared by the layers of every group in that slot."""
        with timed_stage(self.stages, "kv_cache"):
            self._init_cache(num_blocks, max_model_len, num_offload_slots, connector, kv_groups)

    def _init_cache(
        self, num_blocks: int, max_model_len: int, num_offload_slots: int, connector: tuple | None, kv_groups: Any
    ) -> None:
        mc, cc = self.config.model_config, self.config.cache_config
        if self.encoder:
            assert self.model is not None, "load_model() first"
            self.runner = ModelRunner(
                self.model, [], cc.block_size, self.device, mc.seed, parallel=self.ps, pooling=self.pooling
            )
            return
        caches = [
            kv_cache.allocate_kv_caches(
                len(m.layers) if kv_groups is None else kv_groups.num_slots,
                num_blocks,
                cc.block_size,
                *m.kv_cache_shape_per_layer,
                self.kv_cache_dtype,
                self.device,
                prefault=cc.kv_cache_prefault,
            )
            for m in self._kv_models()
        ]
        per_block, full_requests = self.per_block, num_blocks * cc.block_size / max_model_len
        if kv_groups is not None:
            slots, caches[0] = caches[0], [caches[0][s] for s in kv_groups.layer_slot]
            for layer, group in zip(_layers(self._lm), kv_groups.layer_group):
                layer.self_attn.kv_group = group
            per_block = per_block * len(slots) // len(caches[0])
            sc = self.config.scheduler_config  # requests of max_model_len tokens, each holding blocks in every group
            full_requests = num_blocks / kv_groups.blocks_for(
                max_model_len, cc.block_size, sc.max_num_batched_tokens if sc.enable_chunked_prefill else None
            )
        if self.ps.rank == 0:
            logger.info(
                "KV cache: %d blocks of %d tokens (%.2f GiB, %s%s%s); max_model_len %d; max concurrency %.1fx",
                num_blocks,
                cc.block_size,
                num_blocks * per_block / 2**30,
                self.kv_cache_dtype,
                ", prefaulted" if cc.kv_cache_prefault and self.device.type == "cpu" else "",
                f", per rank of {self.ps.world_size}" if self.ps.world_size > 1 else "",
                max_model_len,
                full_requests,
            )
        spec = self.config.speculative_config
        proposer = None
        if spec is not None and self.ps.is_driver:
            from pagedllm.spec_decode import build_proposer

            proposer = build_proposer(
                spec, self.draft, caches[1] if len(caches) > 1 else [], cc.block_size, self.device, self._lm
            )
            logger.info("speculative decoding: %s, %d tokens per step", spec.method, spec.num_speculative_tokens)
        lora = None
        lc = self.config.lora_config
        if lc.enable_lora:
            from pagedllm.lora.manager import LoRAManager

            lora = LoRAManager(self._lm, lc.max_loras, lc.max_lora_rank, self.lora_cache)
        worker_half: OffloadWorker | MooncakeWorker | None = None
        if connector is not None and connector[0] == "mooncake":
            from pagedllm.kv_transfer.mooncake import MooncakeWorker

            worker_half = MooncakeWorker(caches[0], connector[1])
        elif num_offload_slots or connector is not None:
            from pagedllm.kv_transfer.disk import DiskStore
            from pagedllm.kv_transfer.offload import OffloadWorker

            store = None if connector is None else DiskStore(connector[1], connector[2], self.ps.rank)
            worker_half = OffloadWorker(caches[0], num_offload_slots, store)
        self.runner = ModelRunner(
            self._lm,
            caches[0],
            cc.block_size,
            self.device,
            mc.seed,
            processed_logprobs=mc.logprobs_mode == "processed_logprobs",
            proposer=proposer,
            spec_config=spec,
            max_model_len=max_model_len,
            parallel=self.ps,
            lora=lora,
            kv_connector=worker_half,
            pooling=self.pooling,
        )

    def execute_model(
        self, so: SchedulerOutput, prev_sampled: dict[str, list[int]] | None = None
    ) -> ModelRunnerOutput | None:
        """One step. ``prev_sampled``: the tokens the driver sampled last step (the other ranks learn them here)."""
        runner = self.runner
        assert runner is not None, "init_cache() first"
        threads = self.cpu_share.threads_now() if self.cpu_share is not None else self.num_threads
        if threads != self._threads:  # OpenMP's count is per thread: set it in the one that computes
            torch.set_num_threads(threads)
            self._threads = threads
        if prev_sampled:
            runner.apply_sampled(prev_sampled)
        out = runner.execute_model(so)
        connector = runner.kv_connector
        if not so.kv_connector_meta:
            return out if self.ps.is_driver else None
        assert connector is not None, "the scheduler sends connector work only to a worker with a KV tier"
        if so.kv_connector_meta.disk_saves:
            connector.after_forward(so.kv_connector_meta)
        failed, connector.failed = connector.failed, []
        if not self.ps.is_driver:
            if failed:  # only the driver's output can say so; garbage on this rank must not be used
                raise RuntimeError(
                    f"KV disk tier: rank {self.ps.rank} could not load blocks {failed}: their "
                    "files were deleted or replaced after the scheduler checked them"
                )
            return None
        out.kv_transfer_seconds = connector.take_times()
        out.kv_load_failed = failed
        return out

    def comm_stats(self) -> dict[str, int]:
        """Bytes this rank has all-reduced, gathered and sent to the next stage, and tokens it computed."""
        ps = self.ps
        assert self.runner is not None, "init_cache() first"
        return {
            "all_reduce": ps.bytes_all_reduced,
            "gather": ps.bytes_gathered,
            "send": ps.bytes_sent,
            "tokens": self.runner.num_tokens_computed,
        }

    def shard_info(self) -> dict[str, Any]:
        """What this rank holds: its layers, heads and vocabulary rows (for tests and tools)."""
        m = self._lm
        a = _layers(m)[0].self_attn
        emb = m.embed_tokens
        return {
            "rank": self.ps.rank,
            "tp_rank": self.ps.tp_rank,
            "pp_rank": self.ps.pp_rank,
            "layers": [m.start_layer, m.start_layer + len(m.layers)],
            "num_heads": a.num_heads,
            "num_kv_heads": a.num_kv_heads,
            "kv_head_start": a.kv_head_start,
            "mlp_size": _layers(m)[0].mlp.intermediate,
            "vocab_rows": None
            if emb is None
            else getattr(emb, "num_embeddings", None) or cast(torch.Tensor, emb.weight).shape[0],
            "has_head": m.ps.is_last_stage,
            "pid": os.getpid(),
        }

    def _load_draft_model(self, spec: SpeculativeConfig, target: LlamaForCausalLM) -> torch.nn.Module:
        """The draft: another model with the target's vocabulary, or (no ``model``) the target's own weights;
        or a head (EAGLE, EAGLE-3, MEDUSA) that reads the target's hidden states."""
        from pagedllm.model_loader import load_config, resolve_model

        if spec.method != "draft_model":
            from pagedllm.models.spec_heads import load_spec_head

            logger.info("loading the %s head %s", spec.method, spec.model)
            head = load_spec_head(spec.method, spec.model, target, self.dtype, self.device)
            if spec.method == "medusa" and spec.num_speculative_tokens > (n := cast("MedusaHead", head).num_heads):
                raise InvalidParameterError(
                    f"speculative_config.num_speculative_tokens: {spec.num_speculative_tokens} is more than the "
                    f"MEDUSA checkpoint's {n} heads",
                    "speculative_config.num_speculative_tokens",
                )
            if spec.method == "eagle3":
                aux = cast("EagleHead", head).aux_hidden_state_layers(len(target.layers))
                target.aux_hidden_state_layers = aux
            return head

        source, hf_config = self.source, self.hf_config
        if spec.model:
            source = resolve_model(spec.model)
            hf_config = load_config(source)
            if hf_config.vocab_size != self.hf_config.vocab_size:
                raise InvalidParameterError(
                    f"speculative_config.model: the draft model's vocabulary ({hf_config.vocab_size} tokens) differs "
                    f"from the target's ({self.hf_config.vocab_size}); a draft must share the target's tokenizer",
                    "speculative_config.model",
                )
        quantization = spec.quantization
        if quantization is None and source.kind == "gguf" and self.device.type == "cpu":
            # a draft's arithmetic never reaches the output (the target verifies every token): a GGUF draft runs
            # its blocks with int8 activations, llama.cpp's arithmetic and our fastest, not the float32 function
            quantization = "gguf"
        logger.info("loading the draft model %s%s", source.name, f" ({quantization})" if quantization else "")
        return load_model(source, hf_config, self.dtype, self.device, quantization)

    def _profile_peak(self, model: LlamaForCausalLM) -> int:
        """CUDA: the process's memory in use after the weights plus a worst-case activation pass (no KV cache
        yet)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        sc = self.config.scheduler_config
        hidden = torch.zeros(sc.max_num_batched_tokens, model.config.hidden_size, dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            for layer in _layers(model):  # the MLP is the activation peak; attention needs the cache
                layer.mlp(hidden)
            if model.ps.is_last_stage:
                model.compute_logits(hidden[: sc.max_num_seqs])
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)
