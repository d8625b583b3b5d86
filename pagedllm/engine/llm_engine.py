"""LLMEngine: builds the pieces from an EngineConfig and drives them synchronously."""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from pagedllm.config import EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.engine.warmup import WARMUP_BLOCKS, warm_up
from pagedllm.errors import InvalidParameterError
from pagedllm.malloc_arena import share_main_arena
from pagedllm.outputs import RequestOutput
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.worker.loader import resolve_device, resolve_dtype, timed_stage, trim_heap

if TYPE_CHECKING:
    import torch

    from pagedllm.core.kv_groups import KVGroups
    from pagedllm.engine.pooling import PoolingConfig
    from pagedllm.kv_transfer.disk import DiskIndex
    from pagedllm.kv_transfer.mooncake import MooncakeScheduler
    from pagedllm.kv_transfer.offload import OffloadScheduler
    from pagedllm.lora import LoRARequest
    from pagedllm.lora.adapter import AdapterCache
    from pagedllm.multimodal import MultiModalFeature
    from pagedllm.multimodal.processing import MultiModalProcessor
    from pagedllm.pooling_params import PoolingParams
    from pagedllm.structured_output import StructuredOutputManager

logger = logging.getLogger("pagedllm")

_Init = TypeVar("_Init", bound=Callable[..., None])
_T = TypeVar("_T")


def gc_paused(init: _Init) -> _Init:
    """Run ``init`` with Python's cyclic garbage collector paused (as it was before, after).

    A start-up allocates hundreds of thousands of objects that live as long as the engine (transformers'
    modules, the tokenizer, the model's modules), and each automatic collection walks all of them: on the 1.5B
    GGUF the collector took 2 s of a 4.4 s start (the tokenizer's load 1.7 -> 1.0 s, the warm-up 1.7 -> 0.7 s).
    ``init`` ends with one collection of the young generations (what the start-up allocated: the objects
    from before it are not walked again), which frees the start-up's cycles and moves the rest to the oldest
    generation in one pass. Those count towards the oldest generation's next collection as they would have
    with the collector on: one full pass over the heap (0.1-0.2 s on the 1.5B) comes with the first requests
    instead of several during the start. The pause is the whole process's: a server's event loop runs
    without the collector for the seconds its engine starts.
    """

    @functools.wraps(init)
    def run(*args: Any, **kwargs: Any) -> None:
        enabled = gc.isenabled()
        gc.disable()
        try:
            init(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return run  # type: ignore[return-value]


def in_background(fn: Callable[[], _T], name: str) -> Future[_T]:
    """``fn()`` on a daemon thread of its own: its result, or what it raised, from the future's ``result()``."""
    future: Future[_T] = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as e:  # re-raised by result(), on the thread that waits for it
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class LLMEngine:
    @gc_paused
    def __init__(self, config: EngineConfig):
        from pagedllm.model_loader import load_config, load_tokenizer, resolve_model

        # before the threads below start (the kernels' build, the tokenizer's load, heartbeats): each would take an
        # arena of its own, and keep what it freed there resident. The tokenizer's load left 70 of its arena's
        # 106 MiB free and resident (the heap's trim threshold is 1 GiB: keep_activations_in_heap), which
        # malloc_trim does not return from a thread's arena: loaded, the 1.5B's IQ4_XS and Q2_K files now hold 43
        # and 57 MiB less. `pagedllm serve` and the CLI did this already (AsyncLLM: the engine thread's own arena)
        share_main_arena()
        t0 = time.perf_counter()
        self.config = config
        self.startup_stages: dict[str, float] = {}  # seconds per start-up stage, in order
        stage = functools.partial(timed_stage, self.startup_stages)
        mc = config.model_config
        self.source = resolve_model(mc.model)
        self.device = resolve_device(mc.device)
        if self.device.type == "cpu":
            from pagedllm import kernels
            from pagedllm.kernels.isa import chosen_level

            chosen_level()  # a $PAGEDLLM_CPU_LEVEL this machine cannot run fails here, not on the build's thread
            kernels.build_in_background()  # the compiler runs while the config and tokenizer load
        logger.info("loading %s from %s", self.source.name, self.source.path)
        with stage("config"):
            self.hf_config = load_config(self.source)
        self.pooling = self._pooling_runner()  # a pooling runner's PoolingConfig; None: it generates
        self.is_pooling = self.pooling is not None
        if self.is_pooling:
            config = self.config = self._pooling_engine_config(config)
        self.dtype = resolve_dtype(mc.dtype, self.hf_config, self.device)
        from pagedllm.executor import make_executor

        pc = config.parallel_config
        if pc.data_parallel_size > 1:
            raise InvalidParameterError(
                f"data_parallel_size={pc.data_parallel_size}: one engine runs one replica; `pagedllm serve "
                "--data-parallel-size N` runs N of them behind one API server",
                "data_parallel_size",
            )
        if pc.world_size > 1:
            from pagedllm.distributed import check_parallel_fits

            check_parallel_fits(
                self.hf_config, pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.enable_expert_parallel
            )
        self.lora_cache = self._lora_cache()
        self._lora_ids: dict[int, tuple[str, str]] = {}  # lora_int_id -> (name, path): one adapter per id
        # the tokenizer loads on a thread of its own while the weights load and the KV cache is allocated
        # (importing transformers and reading a 151k-token vocabulary: about a second the start no longer waits
        # for); a draft model's config loads on this thread meanwhile, one at a time (TRANSFORMERS_LOADS)
        tokenizer = in_background(functools.partial(load_tokenizer, self.source, mc.tokenizer), "pagedllm-tokenizer")
        try:
            self.executor = make_executor(config, self.source, self.hf_config, self.startup_stages, self.lora_cache)
        except BaseException:
            tokenizer.exception()  # its load ends before the error leaves: nothing runs on after a failed start
            raise
        try:
            num_blocks, stages = self.executor.load_model()
            for name, seconds in stages.items():  # a remote rank 0's loading stages
                self.startup_stages.setdefault(name, seconds)
            self.kv_groups = None if self.is_pooling else self._kv_groups()
            if self.kv_groups is not None and config.cache_config.num_gpu_blocks_override is None:
                # a block holds only a group's layers: the same memory holds that many times more of them
                num_blocks = num_blocks * len(self.kv_groups.layer_group) // self.kv_groups.num_slots
            self.max_model_len = (
                self._pooling_max_model_len(num_blocks) if self.is_pooling else self._resolve_max_model_len(num_blocks)
            )
            offload_slots, block_bytes, disk = 0, 0, None
            kt = config.kv_transfer_config
            mooncake = kt is not None and kt.kv_connector == "MooncakeConnector"
            worker_half: tuple | None = None
            if config.cache_config.kv_offloading_size is not None or kt is not None:
                layouts = self.executor.collective_rpc("kv_block_layout")  # per rank: one block's shape, dtype
                block_bytes = sum(shape.numel() * dtype.itemsize for shape, dtype in layouts)
                if mooncake:
                    assert kt is not None  # (config validation refused what MooncakeConnector cannot run)
                    worker_half = ("mooncake", kt.mooncake_options())
                else:
                    offload_slots = self._offload_slots(block_bytes)
                    disk = self._disk_tier(layouts, block_bytes)
                    if disk is not None:
                        worker_half = ("disk", str(disk.root.parent), disk.fingerprint)
            self.executor.init_cache(num_blocks, self.max_model_len, offload_slots, worker_half, self.kv_groups)
            with stage("tokenizer"):  # the seconds the start waited for it, not the seconds it took
                self.tokenizer = tokenizer.result()
            trim_heap()  # what the tokenizer's load freed (its JSON, ~40 MiB for SmolLM2), as loading's own
            self.num_blocks = num_blocks
            sc = config.scheduler_config
            if not (self.is_pooling or sc.enable_chunked_prefill) and sc.max_num_batched_tokens < self.max_model_len:
                # unchunked, a prompt (or a preempted request's recompute) is computed whole in one step: one longer
                # than the step's budget would wait forever (vLLM's check)
                raise InvalidParameterError(
                    f"max_num_batched_tokens ({sc.max_num_batched_tokens}) is smaller than max_model_len "
                    f"({self.max_model_len}) with enable_chunked_prefill=False: a longer prompt could never be "
                    "scheduled; raise max_num_batched_tokens, lower max_model_len or enable chunked prefill",
                    "max_num_batched_tokens",
                )
            if self.is_pooling and sc.max_num_batched_tokens < self.max_model_len:
                # a pooling prompt is computed whole in one step: the longest must fit the step's budget
                config = self.config = dataclasses.replace(
                    config, scheduler_config=dataclasses.replace(sc, max_num_batched_tokens=self.max_model_len)
                )
            from pagedllm.structured_output import StructuredOutputManager

            so_cfg = config.structured_outputs_config
            eos = self._eos_token_ids()
            self.structured = StructuredOutputManager(  # the grammar library loads with the first constrained request
                self.tokenizer, self.hf_config.vocab_size, eos, so_cfg["backend"], float(so_cfg["compile_timeout"])
            )
            connector: OffloadScheduler | MooncakeScheduler | None = None
            if mooncake:
                connector = self._mooncake_scheduler(layouts[0], block_bytes)
            elif offload_slots or disk is not None:
                from pagedllm.kv_transfer.offload import OffloadScheduler

                connector = OffloadScheduler(
                    offload_slots,
                    config.cache_config.block_size,
                    block_bytes,
                    swap=config.scheduler_config.preemption_mode == "swap",
                    disk=disk,
                )
            self.processor = Processor(
                self.tokenizer, self.hf_config.vocab_size, self.max_model_len, mc.max_logprobs, eos
            )
            self.encoder_budget: tuple[int, int] | None = None  # set for a vision-language model
            self.whole_images = False  # set for Gemma 3: no prefill chunk ends inside an image
            self.mm_processor = self._multimodal_processor()
            with stage("warmup"):  # on a core of its own, dropped after: the engine's own starts untouched
                warm_up(self, self._new_core(None, None, min(num_blocks, WARMUP_BLOCKS)))
        except BaseException:  # a start that fails stops its workers, which let go of what they loaded
            self.executor.shutdown()
            tokenizer.exception()  # and its tokenizer's load has ended
            raise
        self.core = self._new_core(self.structured, connector, num_blocks)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        with stage("gc"):
            gc.collect(1)  # the collector is paused (gc_paused): one pass over the start-up's young objects
        self.startup_seconds = time.perf_counter() - t0
        logger.info(
            "engine ready in %.1fs (%s)",
            self.startup_seconds,
            ", ".join(f"{name} {sec:.1f}s" for name, sec in self.startup_stages.items()),
        )

    def _new_core(
        self,
        structured: StructuredOutputManager | None,
        connector: OffloadScheduler | MooncakeScheduler | None,
        num_blocks: int,
    ) -> EngineCore:
        return EngineCore(
            self.config,
            self.executor,
            num_blocks,
            self.max_model_len,
            structured,
            connector,
            self.kv_groups,
            pooling_needs_kv=not self.pooling_encoder,
            encoder=self.encoder_budget,
            whole_images=self.whole_images,
        )

    def _pooling_runner(self) -> PoolingConfig | None:
        """How this engine pools (``runner='pooling'``, or 'auto' on an encoder), or None when it generates."""
        from pagedllm.engine.pooling import pooling_mode, read_pooling_config
        from pagedllm.models.registry import ModelRegistry

        model_cls = ModelRegistry.resolve_for_config(self.hf_config)
        self.pooling_encoder = bool(getattr(model_cls, "is_pooling_model", False))
        if not pooling_mode(self.config, model_cls, getattr(self.hf_config, "architectures", None)):
            return None
        return read_pooling_config(self.source.path, decoder=not self.pooling_encoder)

    def _pooling_engine_config(self, config: EngineConfig) -> EngineConfig:
        """A pooling runner's config: refuse what does not apply; prefix caching off (a pooling request's
        blocks are freed at once and never reused, as vLLM does by default for pooling models)."""
        pc, cc = config.parallel_config, config.cache_config
        if self.pooling_encoder and pc.world_size > 1:
            raise InvalidParameterError(
                "encoder pooling models (BertModel) run in one process: tensor_parallel_size and "
                f"pipeline_parallel_size must be 1 (got {pc.tensor_parallel_size} and {pc.pipeline_parallel_size}); "
                "Llama-family decoders pool under both",
                "tensor_parallel_size",
            )
        if cc.kv_offloading_size is not None or config.kv_transfer_config is not None:
            raise InvalidParameterError(
                "pooling models keep no KV cache: kv_offloading_size and kv_transfer_config do not apply to them",
                "kv_offloading_size",
            )
        if config.speculative_config is not None:
            raise InvalidParameterError(
                "pooling models sample nothing: speculative_config does not apply to them", "speculative_config"
            )
        if config.lora_config.enable_lora:
            raise InvalidParameterError("LoRA adapters are not supported for pooling models", "enable_lora")
        return dataclasses.replace(config, cache_config=dataclasses.replace(cc, enable_prefix_caching=False))

    def _pooling_max_model_len(self, num_blocks: int) -> int:
        """The longest pooling prompt: max_model_len, the sentence-transformers max_seq_length and the model's
        positions, whichever is least (a decoder's must also fit its KV cache, as for generation)."""
        assert self.pooling is not None  # asked only of a pooling runner
        limits = [
            self.config.model_config.max_model_len,
            self.pooling.max_seq_length,
            getattr(self.hf_config, "max_position_embeddings", None),
        ]
        if not self.pooling_encoder:
            limits.append(self._resolve_max_model_len(num_blocks))
        return min(x for x in limits if x)

    @property
    def hidden_size(self) -> int:
        """The size of a pooling model's vectors."""
        return self.hf_config.hidden_size

    def _lora_cache(self) -> AdapterCache | None:
        lc = self.config.lora_config
        if not lc.enable_lora:
            return None
        from pagedllm.lora.adapter import AdapterCache, load_adapter
        from pagedllm.lora.manager import part_shapes

        loader = functools.partial(
            load_adapter,
            max_rank=lc.max_lora_rank,
            num_layers=self.hf_config.num_hidden_layers,
            part_shapes=part_shapes(self.hf_config),
            base_model=self.source.name,
        )
        return AdapterCache(lc.max_cpu_loras or lc.max_loras, loader)

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """A request's adapter: enabled, one meaning per id, and loadable (it is loaded here, into the CPU
        cache, so a bad adapter fails its own request with the reason)."""
        if lora_request is None:
            return
        from pagedllm.lora import LoRARequest

        if not isinstance(lora_request, LoRARequest):
            raise InvalidParameterError(
                f"lora_request must be a LoRARequest, got {type(lora_request).__name__}", "lora_request"
            )
        if self.lora_cache is None:
            raise InvalidParameterError("lora_request needs an engine started with enable_lora=True", "lora_request")
        known = self._lora_ids.setdefault(lora_request.lora_int_id, (lora_request.lora_name, lora_request.lora_path))
        if known[1] != lora_request.lora_path:
            raise InvalidParameterError(
                f"lora_int_id {lora_request.lora_int_id} already names adapter {known[0]!r} at {known[1]}; "
                "give each adapter its own id",
                "lora_request.lora_int_id",
            )
        try:
            self.lora_cache.get(lora_request)
        except BaseException:
            if lora_request.lora_int_id not in self.lora_cache.ids():
                self._lora_ids.pop(lora_request.lora_int_id, None)
            raise

    def _offload_slots(self, block_bytes: int) -> int:
        """Blocks the RAM tier holds (``block_bytes``: one block on all ranks together)."""
        size = self.config.cache_config.kv_offloading_size
        if size is None:
            return 0
        slots = int(size * (1 << 30)) // block_bytes
        if slots < 1:
            raise InvalidParameterError(
                f"kv_offloading_size={size} GiB holds no KV block (one block is {block_bytes} bytes)",
                "kv_offloading_size",
            )
        logger.info("KV offload tier: %d blocks (%.2f GiB of RAM)", slots, slots * block_bytes / (1 << 30))
        return slots

    def _check_kv_transfer_params(self, params: object) -> None:
        from pagedllm.kv_transfer.mooncake import MooncakeScheduler, check_kv_transfer_params

        kt = self.config.kv_transfer_config
        connector = self.core.scheduler.connector
        layout = connector.layout if isinstance(connector, MooncakeScheduler) else None
        check_kv_transfer_params(params, None if kt is None else kt.kv_role, layout)

    def _kv_identity(self, layouts: list[tuple[torch.Size, torch.dtype]]) -> dict:
        """Everything besides the model's files that changes the KV values a block holds."""
        mc, cc, pc = self.config.model_config, self.config.cache_config, self.config.parallel_config
        return {
            "dtype": str(self.dtype),
            "kv": [str(d) for _, d in layouts],
            "q": mc.quantization,
            "block_size": cc.block_size,
            "tp": pc.tensor_parallel_size,
            "pp": pc.pipeline_parallel_size,
            "ep": pc.enable_expert_parallel,
        }

    def _mooncake_scheduler(self, layout: tuple[torch.Size, torch.dtype], block_bytes: int) -> MooncakeScheduler:
        from pagedllm.kv_transfer.disk import model_fingerprint
        from pagedllm.kv_transfer.mooncake import MooncakeScheduler

        kt = self.config.kv_transfer_config
        assert kt is not None
        shape, dtype = layout
        identity = self._kv_identity([layout])
        info = self.executor.collective_rpc("kv_connector_info")[0]
        return MooncakeScheduler(
            kt.kv_role,
            kt.mooncake_options(),
            self.config.cache_config.block_size,
            block_bytes,
            info,
            {
                "model": model_fingerprint(self.source.path, identity),
                "layers": shape[0],
                "block_size": shape[2],
                "kv_heads": shape[3],
                "head_dim": shape[4],
                "kv_dtype": str(dtype).removeprefix("torch."),
            },
        )

    def _disk_tier(self, layouts: list[tuple[torch.Size, torch.dtype]], block_bytes: int) -> DiskIndex | None:
        kt = self.config.kv_transfer_config
        if kt is None:
            return None
        from pagedllm.kv_transfer.disk import DiskIndex, model_fingerprint

        path, max_gb = kt.disk_options()
        identity = self._kv_identity(layouts)
        try:
            disk = DiskIndex(
                path,
                model_fingerprint(self.source.path, identity),
                len(layouts),
                block_bytes,
                int(max_gb * (1 << 30)),
                [(list(s), d) for s, d in layouts],
                kt.kv_role,
            )
        except OSError as e:
            raise InvalidParameterError(
                f"kv_transfer_config: DiskConnector cannot use {path!r}: {e}",
                "kv_transfer_config.kv_connector_extra_config.path",
            ) from None
        logger.info("KV disk tier: %s, up to %d blocks", disk.root, disk.max_blocks)
        return disk

    def _kv_groups(self) -> KVGroups | None:
        """Block tables of their own for sliding-window layers (:mod:`pagedllm.core.kv_groups`), where the model
        has both kinds and nothing that knows only one table is on."""
        from pagedllm.core.kv_groups import KVGroups

        windows = self.executor.collective_rpc("layer_windows")[0]
        groups = KVGroups.plan(windows)
        if groups is None:
            return None
        cfg, spec = self.config, self.config.speculative_config
        off = [
            why
            for why, on in (
                ("disable_hybrid_kv_cache_manager", cfg.scheduler_config.disable_hybrid_kv_cache_manager),
                ("pipeline parallelism", cfg.parallel_config.pipeline_parallel_size > 1),
                ("a KV offload tier", cfg.cache_config.kv_offloading_size is not None),
                ("a KV connector", cfg.kv_transfer_config is not None),
                ("a draft model's speculative decoding", spec is not None and spec.needs_draft_kv),
            )
            if on
        ]
        if off:
            logger.info("sliding-window layers keep all their KV blocks (%s)", off[0])
            return None
        logger.info(
            "sliding-window layers free the KV blocks behind their window (%d groups of %d layers)",
            len(groups.windows),
            groups.num_slots,
        )
        return groups

    def _resolve_max_model_len(self, num_blocks: int) -> int:
        model_max = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        asked = self.config.model_config.max_model_len
        if asked is not None and asked > model_max:
            raise InvalidParameterError(
                f"max_model_len={asked} exceeds the model's max_position_embeddings ({model_max})", "max_model_len"
            )
        capacity = num_blocks * self.config.cache_config.block_size
        if self.kv_groups is not None:  # the longest request whose blocks in every group fit at once
            sc = self.config.scheduler_config
            capacity = self.kv_groups.max_tokens(
                num_blocks,
                self.config.cache_config.block_size,
                sc.max_num_batched_tokens if sc.enable_chunked_prefill else None,
            )
        if capacity < 2:
            # on CUDA the cache takes the engine's gpu_memory_utilization less its weights and activations, at
            # most what the device has free
            if self.device.type == "cuda":
                setting, advice = "gpu_memory_utilization", "raise gpu_memory_utilization (or free the device's memory)"
            else:
                setting, advice = "kv_cache_memory", "raise kv_cache_memory"
            raise InvalidParameterError(
                f"the KV cache has room for {capacity} tokens: {advice} or set num_gpu_blocks_override", setting
            )
        if asked is not None and asked > capacity:
            # a single request must always fit on its own, or preemption could never make progress
            raise InvalidParameterError(
                f"max_model_len={asked} is larger than the KV cache can hold ({capacity} tokens in "
                f"{num_blocks} blocks{self._groups_note()}); lower max_model_len or give the cache more memory",
                "max_model_len",
            )
        resolved = asked or min(model_max, capacity)
        if asked is None and capacity < model_max:
            logger.warning("max_model_len lowered to %d to fit the KV cache", resolved)
        return resolved

    def _groups_note(self) -> str:
        g = self.kv_groups
        if g is None:
            return ""
        return (
            f", each of {g.num_slots} of the {len(g.layer_group)} layers, a request holding blocks in each of "
            f"{len(g.windows)} groups: see disable_hybrid_kv_cache_manager"
        )

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
        elif self.source.kind == "gguf":  # no generation config: the chat format's end of turn (Gemma's)
            from pagedllm.model_loader.tokenizer import gguf_end_of_turn_id

            end = gguf_end_of_turn_id(self.source.path, self.tokenizer)
            if end is not None:
                ids.add(end)
        return frozenset(ids)

    # -- requests ---------------------------------------------------------------
    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> str:
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.core.scheduler.requests or self.core.is_waiting_for_grammar(request_id):
            raise InvalidParameterError(f"request id {request_id!r} is already in use", "request_id")
        prepared = self.make_request(request_id, prompt, params, priority, lora_request=lora_request)
        self.add_prepared_request(prepared)
        return request_id

    def make_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        group: str | None = None,
        lora_request: LoRARequest | None = None,
        trace_headers: dict[str, str] | None = None,
        max_tokens_must_fit: bool = False,
    ) -> PreparedRequest:
        """Tokenize and validate, touching no engine state (safe from another thread).

        ``max_tokens_must_fit`` refuses a max_tokens the context has no room for instead of
        cutting it (see ``Processor.check``).

        ``n`` > 1 becomes n child requests ``"{i}_{request_id}"``; child i samples with
        seed + i when a seed is given (vLLM's convention), so it reproduces the
        independent request with that seed. ``group`` names the user request it came with
        (the prompts of one batch share it): the FCFS queue serves groups in turn.
        """
        if not isinstance(params, SamplingParams):
            raise InvalidParameterError(f"expected SamplingParams, got {type(params).__name__}", "sampling_params")
        if self.is_pooling:
            raise InvalidParameterError(
                "this is a pooling model (runner='pooling'): use embed or score, not generation", "runner"
            )
        text, ids, features = self._tokenize(prompt)
        if features and params.truncate_prompt_tokens is not None:
            raise InvalidParameterError(
                "truncate_prompt_tokens cannot be used with images: cutting the prompt could cut an image",
                "truncate_prompt_tokens",
            )
        ids = self.processor.truncate(ids, params)
        if params.structured_outputs is not None:
            assert isinstance(params.structured_outputs, StructuredOutputsParams)  # SamplingParams parses a dict
            self.structured.validate(params.structured_outputs)  # a bad schema / regex / grammar: 400 here
        self.check_lora(lora_request)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidParameterError(f"priority must be an integer, got {priority!r}", "priority")
        if priority != 0 and self.config.scheduler_config.scheduling_policy != "priority":
            raise InvalidParameterError("priority needs scheduling_policy='priority'", "priority")
        if params.extra_args is not None and "kv_transfer_params" in params.extra_args:
            self._check_kv_transfer_params(params.extra_args["kv_transfer_params"])
        children = []
        for i in range(params.n):
            child_params = (
                _copy_params(params)
                if params.n == 1
                else dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            )
            max_tokens = self.processor.check(ids, child_params, max_tokens_must_fit)
            rid = request_id if params.n == 1 else f"{i}_{request_id}"
            children.append(
                Request(
                    rid,
                    ids,
                    child_params,
                    max_tokens,
                    priority=priority,
                    parent_id=request_id,
                    index=i,
                    group=group,
                    lora_request=lora_request,
                    trace_headers=trace_headers,
                    mm_features=features,
                )
            )
        children[0].pending_children = children[1:]
        return PreparedRequest(request_id, children, text)

    def _multimodal_processor(self) -> MultiModalProcessor | None:
        """A vision-language model's image processing (None for a text-only model)."""
        if getattr(self.hf_config, "multimodal_config", None) is None:
            return None
        from pagedllm.multimodal.processing import MultiModalProcessor

        processor = MultiModalProcessor(self.source.path, self.hf_config, self.config.multimodal)
        sc = self.config.scheduler_config
        # by default at least one image a step (vLLM's rule), whatever max_num_batched_tokens is
        budget = sc.max_num_encoder_input_tokens or max(sc.max_num_batched_tokens, processor.max_tokens_per_image)
        self.encoder_budget = (budget, sc.encoder_cache_size or budget)
        processor.max_image_tokens = min(self.encoder_budget)
        if not sc.enable_chunked_prefill:
            processor.max_prompt_image_tokens = min(self.encoder_budget)
        processor.check_matches_model(self.source.name)
        from pagedllm.models.registry import ModelRegistry

        self.whole_images = getattr(ModelRegistry.resolve_for_config(self.hf_config), "bidirectional_images", False)
        if (
            self.whole_images
            and sc.enable_chunked_prefill
            and processor.max_tokens_per_image > min(sc.max_num_batched_tokens, budget)
        ):
            raise InvalidParameterError(
                f"{self.source.name}: an image's {processor.max_tokens_per_image} tokens are prefilled in one "
                f"chunk (they attend to each other both ways); max_num_batched_tokens "
                f"({sc.max_num_batched_tokens}) and max_num_encoder_input_tokens must hold them",
                "max_num_batched_tokens",
            )
        return processor

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int], list[MultiModalFeature]]:
        """A prompt's text, token ids and images (a dict's ``multi_modal_data``, expanded into placeholders)."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if data is None:
            text, ids = self.processor.tokenize(
                {k: v for k, v in prompt.items() if k != "multi_modal_data"} if isinstance(prompt, dict) else prompt
            )
            if self.mm_processor is not None:
                self.mm_processor.check_no_placeholders(ids)
            return text, ids, []
        assert isinstance(prompt, dict)  # data came from one
        if self.mm_processor is None:
            raise InvalidParameterError(
                f"{self.source.name} is a text-only model: it takes no images (multi_modal_data)", "multi_modal_data"
            )
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        if unknown:
            raise InvalidParameterError(f"unsupported prompt fields: {sorted(unknown)}", "prompt")
        text, given = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if given is None and not isinstance(text, str):
            raise InvalidParameterError("a prompt dict needs 'prompt' text or 'prompt_token_ids'", "prompt")
        checked = None if given is None else self.processor.tokenize({"prompt_token_ids": given})[1]  # before images
        ids, features = self.mm_processor.process(text if checked is None else None, checked, data)
        return text, self.processor.tokenize({"prompt_token_ids": ids})[1], features

    def make_pooling_requests(
        self,
        request_ids: list[str],
        prompts: list[PromptType],
        params: PoolingParams | None = None,
        priority: int = 0,
        group: str | None = None,
        trace_headers: dict[str, str] | None = None,
    ) -> list[PreparedRequest]:
        """``make_request`` for pooling (embeddings): tokenize (the texts in one tokenizer call), truncate and
        validate every prompt, touching no engine state; all or nothing."""
        from pagedllm.pooling_params import PoolingParams

        if not self.is_pooling:
            raise InvalidParameterError(
                "embed and score need a pooling model (runner='pooling'); this LLM generates text", "runner"
            )
        params = params if params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise InvalidParameterError(f"expected PoolingParams, got {type(params).__name__}", "pooling_params")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidParameterError(f"priority must be an integer, got {priority!r}", "priority")
        if priority != 0 and self.config.scheduler_config.scheduling_policy != "priority":
            raise InvalidParameterError("priority needs scheduling_policy='priority'", "priority")
        out = []
        for rid, (text, ids) in zip(request_ids, self.processor.tokenize_many(prompts)):
            ids = self.processor.check_pooling(ids, params.truncate_prompt_tokens)
            # SamplingParams only so the shared code paths read defaults; a pooling request samples nothing
            req = Request(
                rid,
                ids,
                SamplingParams(max_tokens=1, detokenize=False),
                0,
                priority=priority,
                parent_id=rid,
                group=group,
                trace_headers=trace_headers,
                pooling_params=params,
            )
            out.append(PreparedRequest(rid, [req], text))
        return out

    def add_prepared_request(self, prepared: PreparedRequest) -> None:
        self.output_processor.add_request(prepared.request_id, prepared.children, prepared.prompt)
        self.core.add_request(prepared.children[0])

    def abort_request(self, request_ids: list[str]) -> None:
        self.core.abort_requests([c for rid in request_ids for c in self.output_processor.child_ids(rid)])

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def shutdown(self) -> None:
        """Stop the workers (worker processes or Ray actors); the engine serves nothing after this."""
        if (connector := self.core.scheduler.connector) is not None:
            connector.close()
        self.executor.shutdown()

    def idle_wake_s(self) -> float | None:
        """How long the engine may sleep with nothing to compute (None: until a request comes)."""
        connector = self.core.scheduler.connector
        return connector.idle_wake_s() if connector is not None else None

    @property
    def fault_hook(self) -> Callable[[str, Any], None] | None:
        """For tests: ``fault_hook(stage, scheduler_output)`` runs in every step (see EngineCore.fault_hook) and
        stays across rebuilds."""
        return self.core.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: Callable[[str, Any], None] | None) -> None:
        self.core.fault_hook = hook

    def can_rebuild(self) -> bool:
        """Whether :meth:`rebuild` can start over in this process: one process holds every worker's state, and no
        KV connector holds blocks for a peer or a tier that a new block pool would not know."""
        from pagedllm.executor.uniproc import UniprocExecutor

        core = self.core
        return (
            isinstance(self.executor, UniprocExecutor) and core.scheduler.connector is None and core.max_in_flight == 1
        )

    def rebuild(self) -> None:
        """A new engine core (scheduler, block pool, queues) over the same worker and weights, after a step failed
        in a way no request could be blamed for. Every request is dropped (the caller tells their clients); the
        runner forgets them with the new core's first step; the KV cache's contents no longer matter."""
        old = self.core
        stale = set(old.scheduler.requests) | old.scheduler.finished_req_ids | {r.request_id for r in old._grammar_wait}
        for rid in stale:
            self.structured.remove(rid)
        self.core = self._new_core(self.structured, None, self.num_blocks)
        self.core.fault_hook = old.fault_hook
        self.core.scheduler.finished_req_ids |= stale
        self.output_processor = OutputProcessor(self.tokenizer)

    def step(self) -> list[RequestOutput]:
        outputs, to_stop = self.output_processor.process(self.core.step())
        for rid, stop in to_stop:
            self.core.finish_request(rid, stop)
        return outputs

    def get_num_unfinished_requests(self) -> int:
        s = self.core.scheduler
        return len(s.running) + len(s.waiting) + self.core.num_waiting_for_grammar()


@dataclasses.dataclass(slots=True)
class PreparedRequest:
    request_id: str
    children: list[Request]  # one per completion (n); the first computes the prompt
    prompt: str | None


def _copy_params(params: SamplingParams) -> SamplingParams:
    """Each request gets its own copy: bind_eos must not leak into a params object shared by a batch."""
    import copy

    return copy.copy(params)
