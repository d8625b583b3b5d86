"""Engine configuration: one set of typed dataclasses is the single source of truth.

``LLM(**kwargs)`` and the CLI flags are both generated from the fields below
(see :func:`EngineConfig.from_kwargs` and :mod:`pagedllm.entrypoints.cli`), with
vLLM's names so a vLLM user's habits carry over. Each field's help text lives in
its ``metadata``; there is no second list of defaults anywhere else.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pagedllm.errors import InvalidParameterError

if TYPE_CHECKING:
    from pagedllm.kv_transfer.config import KVTransferConfig
    from pagedllm.spec_decode.config import SpeculativeConfig

GiB = 1 << 30


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(slots=True, frozen=True)
class ModelConfig:
    model: str | None = _f(
        None,
        "Path to an HF directory or .gguf file, or an HF repo id already in the local cache. "
        "Default: the embedded SmolLM2-135M-Instruct.",
        positional=True,
    )
    tokenizer: str | None = _f(None, "Tokenizer path; defaults to the model's own.")
    runner: Literal["auto", "generate", "pooling"] = _f(
        "auto",
        "'generate' (text generation) or 'pooling' (embeddings and scores: llm.embed / llm.score, "
        "/v1/embeddings); 'auto' picks pooling for encoder models (BertModel).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _f(
        "auto",
        "Weight and activation dtype. 'auto' is float32 on CPU and the checkpoint's dtype (or bfloat16) on CUDA.",
    )
    max_model_len: int | None = _f(
        None, "Context length (prompt + output). Defaults to the model's, capped to what the KV cache can hold."
    )
    served_model_name: str | None = _f(None, "Name reported in outputs and the API. Defaults to the model argument.")
    seed: int = _f(0, "Seed for requests that give none.")
    max_logprobs: int = _f(20, "Largest `logprobs` / `prompt_logprobs` a request may ask for.")
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = _f(
        "raw_logprobs",
        "What returned logprobs describe: the model's raw distribution, or the processed one "
        "actually sampled from (after penalties, bias, temperature, top-k/top-p/min-p).",
    )
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "Device to run on; 'auto' picks CUDA when available.")
    cpu_threads: int | None = _f(
        None,
        "Threads each CPU worker computes with. Default: its share of the cores this process may use, lowered "
        "while other processes keep some of them busy and raised again when they are free (measured each "
        "second from /proc/stat): a thread whose core another process holds stalls every parallel step. "
        "A number fixes the count.",
    )
    enforce_eager: bool = _f(
        False,
        "Run every step through the Python layer loop. By default a decode-only step of a Llama-family "
        "model on CPU (float32 or quantized) runs its layers in one C call (the same kernels, the same result).",
    )
    quantization: Literal["gguf", "gguf-exact", "int8", "int4", "w4a8", "w4a16", "fp8", "none"] | None = _f(
        None,
        "Quantization on CPU. A GGUF file runs as stored by default: 'gguf' where every quantized tensor is "
        "of a type with panels (Q2_K-Q6_K / Q8_0 / Q5_0 / Q5_1 / Q4_0 / Q4_1 / IQ4_NL / IQ4_XS) in whole panels, "
        "the CPU has AVX2 and the model runs in one process (a Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0 or Q4_1 file, the "
        "embedded default among them: one kernel at every batch size), else "
        "'gguf-exact'. 'gguf-exact': each tensor keeps its own "
        "block type (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q2_K-Q6_K / IQ4_NL / IQ4_XS; float tensors "
        "stay float), nothing "
        "is widened, activations stay float32: the float32 function of the dequantized weights (transformers' "
        "tokens), the same whatever else a step's batch holds. 'gguf': the same blocks (repacked into panels of "
        "16 rows from AVX2 up, else Q4_K / Q6_K read in place from the file's mapping) with activations rounded "
        "to int8 for integer dot products, as llama.cpp does: faster decode, not float32's function; a request's "
        "tokens may change with the batch it runs in where a tensor is not in panels (a rounding step moved by "
        "another summation order). 'none': widen "
        "every weight to --dtype (the old GGUF default; AWQ / GPTQ / FP8 checkpoints are widened too). "
        "Weight-only, float32 activations: 'int8' or 'int4' (groups of 32 with a "
        "scale and a min; a GGUF's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K blocks load without a second "
        "rounding). 'w4a8': int4 "
        "weights with activations rounded to int8 per group of 32 and integer dot products, as llama.cpp "
        "computes (faster decode and batches, not the float32 function: see `pagedllm bench accuracy`). "
        "'w4a16': the same with activations rounded to int16 (two int8 digits, twice the integer products): "
        "the float32 function's greedy tokens, faster batches than float32. 'fp8': e4m3 weights "
        "with a scale per row, float32 activations (an FP8 checkpoint's own weights; chosen by itself for one).",
    )


@dataclass(slots=True, frozen=True)
class CacheConfig:
    block_size: int = _f(16, "Tokens per KV cache block.")
    kv_cache_memory: int | None = _f(
        None,
        "Bytes for the KV cache on CPU. Default: what max_num_seqs requests of max_model_len tokens fill, at most "
        "4 GiB (vLLM's CPU default) and half the memory available; VLLM_CPU_KVCACHE_SPACE (GiB) is read when unset.",
    )
    gpu_memory_utilization: float = _f(
        0.9,
        "Fraction of GPU memory this engine may use (weights + activations + KV cache): a limit per engine, as in "
        "vLLM (two engines of 0.45 share one device), and never more than is free at start-up.",
    )
    num_gpu_blocks_override: int | None = _f(
        None, "Use exactly this many KV blocks, whatever the memory budget says (for tests)."
    )
    enable_prefix_caching: bool = _f(True, "Reuse KV blocks of identical prompt prefixes across requests.")
    kv_cache_prefault: bool = _f(
        False,
        "Write every page of a CPU KV cache at start-up, so all of it is resident "
        "from the first request: a memory limit fails at start rather than hours in, and "
        "RSS stays flat. Without it, pages become resident as blocks are first used.",
    )
    kv_offloading_size: float | None = _f(
        None,
        "GiB of RAM for a second KV tier behind the prefix cache (all ranks together): cached blocks the "
        "cache evicts are kept there, least recently used dropped first, and a prefix found there is loaded back "
        "instead of recomputed. Needs enable_prefix_caching.",
    )
    kv_offloading_backend: Literal["native"] = _f(
        "native", "The offload tier's implementation: 'native' (a RAM pool in each worker, pinned on CUDA)."
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"] = _f(
        "auto",
        "KV cache storage dtype; 'auto' uses the model dtype. fp8 (= fp8_e4m3) and fp8_e5m2 store "
        "unscaled 8-bit floats, converted back to the model dtype when attention reads them; int8 stores each "
        "token's K and V of each kv head as 8-bit integers with a float32 scale of their own (a quarter of float32's "
        "bytes, plus 4 a row).",
    )


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_seqs: int = _f(256, "Most requests running at once.")
    max_num_batched_tokens: int = _f(2048, "Token budget of one engine step (prefill chunks + decodes).")
    enable_chunked_prefill: bool = _f(True, "Split long prompts across steps to fit the token budget.")
    preemption_mode: Literal["recompute", "swap"] = _f(
        "recompute",
        "What a request preempted for lack of KV blocks loses: 'recompute' frees its blocks (its "
        "full blocks stay prefix-cached, and with an offload tier reach RAM when evicted); 'swap' also keeps its "
        "partial last block in the offload tier, so it resumes without recomputing anything. Needs "
        "kv_offloading_size.",
    )
    scheduling_policy: Literal["fcfs", "priority"] = _f(
        "fcfs",
        "Order of admission: arrival (the prompts and completions of one request take turns with other "
        "requests), or (priority, arrival) with lower values first.",
    )
    max_num_encoder_input_tokens: int | None = _f(
        None,
        "Vision-language models: image tokens the vision encoder may compute in one step (default: "
        "max_num_batched_tokens); a prompt chunk that reaches an image not yet encoded stops before it "
        "when the budget is spent, so one large image cannot stall the decodes.",
    )
    encoder_cache_size: int | None = _f(
        None,
        "Vision-language models: image tokens whose encoder outputs are kept (by image hash) for the chunks, "
        "preempted requests and n > 1 siblings that read them again (default: max_num_encoder_input_tokens).",
    )
    disable_hybrid_kv_cache_manager: bool = _f(
        False,
        "Keep every KV block of sliding-window (local) layers, as full-attention layers keep theirs. By "
        "default a model with both kinds (Gemma 3) gives its local layers block tables of their own and frees the "
        "blocks that fall behind their window (vLLM's hybrid KV cache manager); that is also off under pipeline "
        "parallelism, a KV offload or disk tier, a KV connector and a draft model's speculative decoding.",
    )


@dataclass(slots=True, frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = _f(
        1,
        "Tensor-parallel ranks: each holds 1/tp of every layer's heads and MLP, and of the vocabulary "
        "(Megatron style, one all-reduce after attention and one after the MLP).",
    )
    pipeline_parallel_size: int = _f(
        1, "Pipeline stages: each holds a contiguous share of the layers and hands its activations to the next."
    )
    distributed_executor_backend: Literal["uniproc", "mp", "ray"] | None = _f(
        None,
        "How the tp x pp workers are started: 'mp' (processes on this node; the default above one "
        "worker), 'ray' (Ray actors across a Ray cluster's nodes), or 'uniproc' (in-process; one worker only).",
    )
    enable_expert_parallel: bool = _f(
        False,
        "Mixture-of-Experts models under tensor parallelism: each rank holds "
        "1/tp of the experts whole (and runs them for every token) instead of a "
        "slice of every expert; the partial outputs are summed by the all-reduce "
        "the layer needs anyway.",
    )
    data_parallel_size: int = _f(
        1,
        "Engine replicas, each its own process (with its own tp x pp workers), behind "
        "one API server that balances them (`pagedllm serve`).",
    )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(slots=True, frozen=True)
class LoRAConfig:
    enable_lora: bool = _f(False, "Serve LoRA adapters (PEFT format) over the base model; requests name one.")
    max_loras: int = _f(1, "Adapters active at once: distinct adapters in one running batch.")
    max_lora_rank: int = _f(16, "Largest adapter rank accepted (slots are padded to it).")
    max_cpu_loras: int | None = _f(
        None, "Adapters kept loaded in memory, least recently used evicted first (default: max_loras)."
    )


@dataclass(slots=True, frozen=True)
class SpeculativeSection:
    speculative_config: dict | None = field(
        default=None,
        metadata={
            "help": (
                'Speculative decoding, as vLLM\'s JSON object: {"method": "ngram" | "draft_model" | '
                '"eagle" | "eagle3" | "medusa", "num_speculative_tokens": k, "model": path, ...}; '
                "see docs/speculative.md for every key."
            )
        },
    )


@dataclass(slots=True, frozen=True)
class StructuredOutputsSection:
    structured_outputs_config: dict | None = field(
        default=None,
        metadata={
            "help": (
                'Structured outputs, as a JSON object: {"backend": "xgrammar" | "guidance" | "auto", '
                '"compile_timeout": seconds (30)}.'
            )
        },
    )


@dataclass(slots=True, frozen=True)
class KVTransferSection:
    kv_transfer_config: dict | None = field(
        default=None,
        metadata={
            "help": (
                'A KV connector, as vLLM\'s JSON object: {"kv_connector": name, "kv_role": "kv_both" | '
                '"kv_producer" | "kv_consumer", "kv_connector_extra_config": {...}}; see docs/scaling.md.'
            )
        },
    )


@dataclass(slots=True, frozen=True)
class MultiModalSection:
    limit_mm_per_prompt: dict | None = field(
        default=None,
        metadata={
            "help": 'Most items of each modality one prompt may carry, as vLLM\'s JSON object: {"image": N}. '
            'Default {"image": 4}. Only for a vision-language model.'
        },
    )
    max_image_pixels: int = _f(
        16_777_216, "Largest image (width x height, before the processor resizes it) a request may send."
    )
    max_image_bytes: int = _f(20 * 1024 * 1024, "Largest encoded image (a data: URL's or a fetched file's bytes).")
    max_pixels_in_flight: int = _f(
        4 * 16_777_216,
        "Most pixels of decoded images the server holds at once across all requests (a request's images count "
        "from their decoding until the processor has turned them into features); the rest wait their turn, "
        "up to 30 s, then get a 503. At least max_image_pixels.",
    )
    allowed_local_media_path: str | None = _f(
        None, "A folder whose files requests may name as file:// image URLs (default: none may be read)."
    )
    allowed_media_domains: str | None = _f(
        None,
        "Comma-separated host names whose http(s) image URLs the server fetches (default: none: images come "
        "as data: URLs). A fetch has --media-fetch-timeout seconds and --max-image-bytes.",
    )
    media_fetch_timeout: float = _f(5.0, "Seconds an image URL's fetch may take, connection included.")

    def limits(self) -> dict[str, int]:
        """The checked per-prompt limits by modality."""
        raw = dict(self.limit_mm_per_prompt) if self.limit_mm_per_prompt is not None else {"image": 4}
        unknown = set(raw) - {"image"}
        if unknown:
            raise InvalidParameterError(
                f"limit_mm_per_prompt: unknown modality {sorted(unknown)[0]!r}; supported: image",
                "limit_mm_per_prompt",
            )
        for name, value in raw.items():
            _positive(f"limit_mm_per_prompt.{name}", value, allow_zero=True)
        return raw

    def domains(self) -> frozenset[str]:
        return frozenset(d.strip().lower() for d in (self.allowed_media_domains or "").split(",") if d.strip())


_SECTIONS = {
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
    "lora_config": LoRAConfig,
    "speculative": SpeculativeSection,
    "structured": StructuredOutputsSection,
    "kv_transfer": KVTransferSection,
    "multimodal": MultiModalSection,
}


@dataclass(slots=True, frozen=True)
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)
    speculative: SpeculativeSection = field(default_factory=SpeculativeSection)
    structured: StructuredOutputsSection = field(default_factory=StructuredOutputsSection)
    kv_transfer: KVTransferSection = field(default_factory=KVTransferSection)
    multimodal: MultiModalSection = field(default_factory=MultiModalSection)

    @property
    def kv_transfer_config(self) -> KVTransferConfig | None:
        from pagedllm.kv_transfer import KVTransferConfig

        return KVTransferConfig.parse(self.kv_transfer.kv_transfer_config)

    @property
    def structured_outputs_config(self) -> dict[str, Any]:
        """The checked structured-outputs settings: backend and compile_timeout."""
        raw = self.structured.structured_outputs_config
        if isinstance(raw, str):
            import json

            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise InvalidParameterError(
                    f"structured_outputs_config is not valid JSON: {e}", "structured_outputs_config"
                ) from None
        raw = dict(raw or {})
        if not isinstance(raw, dict):
            raise InvalidParameterError("structured_outputs_config must be a JSON object", "structured_outputs_config")
        out = {"backend": raw.pop("backend", "xgrammar"), "compile_timeout": raw.pop("compile_timeout", 30.0)}
        if raw:
            raise InvalidParameterError(
                f"structured_outputs_config: unknown keys {sorted(raw)}; valid: backend, compile_timeout",
                f"structured_outputs_config.{sorted(raw)[0]}",
            )
        if out["backend"] not in ("xgrammar", "guidance", "auto"):
            raise InvalidParameterError(
                f"structured_outputs_config.backend: {out['backend']!r} is not available; use 'xgrammar', "
                "'guidance' or 'auto'",
                "structured_outputs_config.backend",
            )
        t = out["compile_timeout"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise InvalidParameterError(
                f"structured_outputs_config.compile_timeout must be > 0 seconds, got {t!r}",
                "structured_outputs_config.compile_timeout",
            )
        return out

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        from pagedllm.spec_decode.config import SpeculativeConfig

        raw = self.speculative.speculative_config
        return None if raw is None else SpeculativeConfig.from_dict(raw)

    @staticmethod
    def all_fields() -> list[tuple[str, dataclasses.Field]]:
        """Every user-settable field as (section, field), in declaration order."""
        return [(sec, f) for sec, cls in _SECTIONS.items() for f in dataclasses.fields(cls)]

    @staticmethod
    def field_type(section: str, name: str) -> Any:
        """The resolved type of a field (the annotations are strings under `from __future__`)."""
        return typing.get_type_hints(_SECTIONS[section])[name]

    @staticmethod
    def choices(section: str, name: str) -> tuple | None:
        """The values a ``Literal`` field allows (with None when it is optional), else None."""
        hint = EngineConfig.field_type(section, name)
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        literals = [a for a in args if typing.get_origin(a) is typing.Literal]
        if not literals:
            return None
        return tuple(v for lit in literals for v in typing.get_args(lit)) + ((None,) if type(None) in args else ())

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Distribute flat vLLM-style keyword arguments to the section owning each name."""
        per_section: dict[str, dict[str, Any]] = {sec: {} for sec in _SECTIONS}
        owner = {f.name: sec for sec, f in cls.all_fields()}
        for name, value in kwargs.items():
            if name not in owner:
                raise InvalidParameterError(
                    f"unknown engine argument {name!r}; valid arguments: {', '.join(sorted(owner))}", param=name
                )
            per_section[owner[name]][name] = value
        config = cls(**{sec: _SECTIONS[sec](**vals) for sec, vals in per_section.items()})
        config.validate()
        return config

    def validate(self) -> None:
        m, c, s, p = self.model_config, self.cache_config, self.scheduler_config, self.parallel_config
        for section, f in self.all_fields():  # every Literal field: its annotation is the list of choices
            allowed = self.choices(section, f.name)
            if allowed is not None:
                _choice(f.name, getattr(getattr(self, section), f.name), allowed)
        _positive("block_size", c.block_size)
        _positive("max_num_seqs", s.max_num_seqs)
        _positive("max_num_batched_tokens", s.max_num_batched_tokens)
        _positive("max_logprobs", m.max_logprobs, allow_zero=True)
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            if getattr(s, name) is not None:
                _positive(name, getattr(s, name))
        mm = self.multimodal
        mm.limits()
        if mm.allowed_local_media_path is not None and not os.path.isdir(mm.allowed_local_media_path):
            raise InvalidParameterError(
                f"allowed_local_media_path {mm.allowed_local_media_path!r} is not a directory",
                "allowed_local_media_path",
            )
        _positive("max_image_pixels", mm.max_image_pixels)
        _positive("max_pixels_in_flight", mm.max_pixels_in_flight)
        if mm.max_pixels_in_flight < mm.max_image_pixels:
            raise InvalidParameterError(
                f"max_pixels_in_flight ({mm.max_pixels_in_flight}) must be at least max_image_pixels "
                f"({mm.max_image_pixels}): an image at the limit could never be decoded",
                "max_pixels_in_flight",
            )
        _positive("max_image_bytes", mm.max_image_bytes)
        t = mm.media_fetch_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise InvalidParameterError(f"media_fetch_timeout must be > 0 seconds, got {t!r}", "media_fetch_timeout")
        if m.max_model_len is not None:
            _positive("max_model_len", m.max_model_len)
        if m.cpu_threads is not None:
            _positive("cpu_threads", m.cpu_threads)
        if c.num_gpu_blocks_override is not None:
            _positive("num_gpu_blocks_override", c.num_gpu_blocks_override)
        if c.kv_cache_memory is not None:
            _positive("kv_cache_memory", c.kv_cache_memory)
        if not 0.0 < c.gpu_memory_utilization <= 1.0:
            raise InvalidParameterError(
                f"gpu_memory_utilization must be in (0, 1], got {c.gpu_memory_utilization}", "gpu_memory_utilization"
            )
        self.speculative_config  # noqa: B018 -- parses, raising on a bad key or value
        self.structured_outputs_config  # noqa: B018
        _positive("tensor_parallel_size", p.tensor_parallel_size)
        _positive("pipeline_parallel_size", p.pipeline_parallel_size)
        _positive("data_parallel_size", p.data_parallel_size)
        if p.distributed_executor_backend == "uniproc" and p.world_size > 1:
            raise InvalidParameterError(
                f"distributed_executor_backend='uniproc' runs one worker, but tensor_parallel_size x "
                f"pipeline_parallel_size is {p.world_size}; use 'mp' or 'ray'",
                "distributed_executor_backend",
            )
        lc = self.lora_config
        _positive("max_loras", lc.max_loras)
        _positive("max_lora_rank", lc.max_lora_rank)
        if lc.max_cpu_loras is not None:
            _positive("max_cpu_loras", lc.max_cpu_loras)
            if lc.max_cpu_loras < lc.max_loras:
                raise InvalidParameterError(
                    f"max_cpu_loras ({lc.max_cpu_loras}) must be >= max_loras ({lc.max_loras})", "max_cpu_loras"
                )
        if lc.enable_lora and p.world_size > 1:
            raise InvalidParameterError(
                "enable_lora with tensor or pipeline parallelism is not supported yet", "enable_lora"
            )
        tiers = [
            name
            for name, on in (
                ("kv_offloading_size", c.kv_offloading_size is not None),
                ("kv_transfer_config", self.kv_transfer_config is not None),
            )
            if on
        ]
        if c.kv_offloading_size is not None:
            size = c.kv_offloading_size
            if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
                raise InvalidParameterError(f"kv_offloading_size must be > 0 GiB, got {size!r}", "kv_offloading_size")
        kt = self.kv_transfer_config
        if kt is not None and kt.kv_connector == "MooncakeConnector":
            tiers.remove("kv_transfer_config")  # (it reads a request's blocks by id, not by their hashes)
            for name, value in (
                ("tensor_parallel_size", p.tensor_parallel_size),
                ("pipeline_parallel_size", p.pipeline_parallel_size),
            ):
                if value != 1:
                    raise InvalidParameterError(
                        f"kv_transfer_config: MooncakeConnector runs one rank per engine; {name}={value} is not "
                        "supported yet (run the producer and consumer unsharded, or use DiskConnector)",
                        name,
                    )
            if c.kv_offloading_size is not None:
                raise InvalidParameterError(
                    "kv_offloading_size cannot be combined with MooncakeConnector yet (one KV connector per engine)",
                    "kv_offloading_size",
                )
            spec = self.speculative_config
            if spec is not None and spec.needs_draft_kv:
                raise InvalidParameterError(
                    f"kv_transfer_config: MooncakeConnector with speculative_config.method={spec.method!r} is not "
                    "supported yet: it moves the target model's KV only",
                    "kv_transfer_config",
                )
        if tiers and not c.enable_prefix_caching:
            raise InvalidParameterError(
                f"{tiers[0]} needs enable_prefix_caching: the KV tiers find blocks by their prefix hashes", tiers[0]
            )
        if kt is not None and self.lora_config.enable_lora:
            raise InvalidParameterError(
                "kv_transfer_config with enable_lora is not supported yet: a KV block does not say which "
                "adapter computed it",
                "kv_transfer_config",
            )
        if s.preemption_mode == "swap" and c.kv_offloading_size is None:
            raise InvalidParameterError(
                "preemption_mode='swap' needs an offload tier to swap to: set kv_offloading_size", "preemption_mode"
            )
        spec = self.speculative_config
        if tiers and spec is not None and spec.needs_draft_kv:
            raise InvalidParameterError(
                f"{tiers[0]} with speculative_config.method={spec.method!r} is not supported yet: the KV tiers "
                "keep the target model's KV only",
                tiers[0],
            )
        if p.world_size > 1 and spec is not None and spec.method != "ngram":
            raise InvalidParameterError(
                f"speculative_config.method={spec.method!r} runs in one process; with tensor or pipeline "
                "parallelism only 'ngram' is supported",
                "speculative_config.method",
            )


def _choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise InvalidParameterError(f"{name} must be one of {list(allowed)}, got {value!r}", name)


def _positive(name: str, value: Any, allow_zero: bool = False) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if allow_zero else 1):
        bound = ">= 0" if allow_zero else ">= 1"
        raise InvalidParameterError(f"{name} must be an integer {bound}, got {value!r}", name)
