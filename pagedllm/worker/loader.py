"""Build the model for a resolved checkpoint: pick the class, place it, load weights."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.distributed import ParallelState
from pagedllm.models.registry import ModelRegistry

if TYPE_CHECKING:
    from pagedllm.models.llama import LlamaForCausalLM

logger = logging.getLogger("pagedllm")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        from pagedllm.errors import InvalidParameterError

        raise InvalidParameterError("device='cuda' was asked for but no CUDA device is available", "device")
    return torch.device(name)


def resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # fp32 matmuls are the fast, exact path on most CPUs
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(ckpt, str):
        ckpt = DTYPES.get(ckpt)
    return ckpt if ckpt in (torch.float16, torch.bfloat16) else torch.bfloat16


def load_model(
    source: Any,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    stages: dict[str, float] | None = None,
    parallel: ParallelState | None = None,
) -> torch.nn.Module:
    """Build and load the model (this rank's shard of it under ``parallel``); ``stages`` (if given)
    receives the seconds spent on weights and packing."""
    from pagedllm.model_loader import iter_weights
    from pagedllm.model_loader.quant_config import checkpoint_scheme

    scheme = checkpoint_scheme(hf_config) if source.kind == "hf_dir" else None  # AWQ, GPTQ
    single = parallel is None or parallel.world_size == 1
    quantization = resolve_quantization(quantization, source, scheme, device, single)
    if source.kind == "gguf":  # a truncated file, or blocks with no kernel, fail before anything is built
        from pagedllm.layers.quantization import GGUF_MODES
        from pagedllm.model_loader.gguf_loader import check_gguf_tensors

        check_gguf_tensors(source.path, as_stored=quantization in GGUF_MODES)
    if quantization is not None:
        from pagedllm.layers.quantization import check_quantization_supported

        check_quantization_supported(quantization, device)

    if device.type == "cpu":
        from pagedllm.layers.linear import bound_onednn_caches

        bound_onednn_caches()
    t0 = time.perf_counter()
    model_cls = ModelRegistry.resolve_for_config(hf_config)
    logger.info("loading weights (%s, %s)", model_cls.__name__, device)
    # load_weights overwrites every parameter (or raises): skip random initialisation where it says so
    skip_init = getattr(model_cls, "checkpoint_sets_every_parameter", False)
    sharded = parallel is not None and parallel.world_size > 1
    if sharded and getattr(scheme, "act_order", False):
        from pagedllm.errors import InvalidParameterError

        raise InvalidParameterError(
            "GPTQ act-order (desc_act) checkpoints do not run under tensor or pipeline parallelism yet",
            "tensor_parallel_size",
        )
    if sharded and not getattr(model_cls, "supports_parallel", False):
        from pagedllm.errors import InvalidParameterError

        raise InvalidParameterError(
            f"{model_cls.__name__} does not support tensor or pipeline parallelism", "tensor_parallel_size"
        )
    with torch.device(device), _no_init() if skip_init else contextlib.nullcontext():
        model = model_cls(hf_config, parallel=parallel) if sharded else model_cls(hf_config)
    model.to(dtype=dtype)  # before loading: the checkpoint's float32 values are copied in as dtype
    n_params = sum(p.numel() for p in model.parameters())
    blocks: dict[str, Any] | None = None
    skip: set[str] = set()
    if quantization is not None:  # layers that take the checkpoint's own blocks get them before any weight
        blocks, skip = _take_blocks(model, source, quantization, scheme)
    if scheme is not None:
        from pagedllm.model_loader.hf_loader import iter_raw

        model.load_weights(scheme.iter_float(iter_raw(source.path), skip))
    else:
        model.load_weights(iter_weights(source, lazy=sharded, skip=skip))
    model.eval()
    t1 = time.perf_counter()
    if quantization is not None:
        _quantize(model, quantization, blocks, scheme)
        del blocks  # the blocks a layer did not keep as they are (widened, or cut) go before the heap is trimmed
    if device.type == "cpu" and dtype == torch.float32:
        from pagedllm.layers.linear import onednn_available, pack_linears

        if onednn_available():
            pack_linears(model)
    t2 = time.perf_counter()
    if stages is not None:
        stages["weights"], stages["pack"] = t1 - t0, t2 - t1
    logger.info(
        "loaded %s (%.1fM params, %s%s, %s) in %.1fs",
        model_cls.__name__,
        n_params / 1e6,
        dtype,
        f", weights {quantization}" if quantization else "",
        device,
        t2 - t0,
    )
    trim_heap()
    return model


def resolve_quantization(
    asked: str | None, source: Any, scheme: Any, device: torch.device, single: bool = True
) -> str | None:
    """The weight format a model loads in: what was asked; else an AWQ / GPTQ / FP8 checkpoint's own scheme,
    and on CPU a GGUF's blocks as stored: with int8 activations ("gguf", llama.cpp's arithmetic) where every
    quantized tensor runs in panels of 16 rows (one kernel at every batch size, so a request's tokens do not
    depend on what shares its steps; one process: ``single``), else with float32 activations ("gguf-exact").
    "none" widens every weight to the model dtype."""
    from pagedllm.layers.quantization import GGUF_MODES

    if asked in GGUF_MODES and source.kind != "gguf":
        from pagedllm.errors import InvalidParameterError

        raise InvalidParameterError(
            f"quantization={asked!r} runs a GGUF file's blocks as stored, but {source.name!r} is not a GGUF file",
            "quantization",
        )
    if asked == "none":
        return None
    if asked is None and scheme is not None:
        return str(scheme.method)  # the checkpoint's own 4- or 8-bit groups, as they are
    if asked is None and source.kind == "gguf" and device.type == "cpu":
        from pagedllm import kernels
        from pagedllm.model_loader.gguf_loader import all_in_panels

        mode = "gguf" if single and all_in_panels(source.path) else "gguf-exact"
        found = kernels.try_load()
        level = f" at the {found.level} kernel level" if found is not None else ""
        logger.info("quantization %s: the default for %s on this CPU%s", mode, source.name, level)
        return mode
    return asked


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``; elsewhere nothing). Loading
    frees its temporaries (dequantized GGUF tensors, float32 weights before packing or quantizing) in
    pieces that glibc keeps for reuse: 0.27 GiB of a SmolLM2 server's 2.3 GiB RSS after start-up."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


# glibc's malloc hands an allocation past its threshold (at most 32 MiB, adjusted as memory is freed) to mmap,
# and munmap takes it back at free (a TLB shootdown on every core the process runs on); the next one's pages
# fault in and are zeroed again. A prefill chunk's activations are such allocations (512 tokens of
# Qwen2.5-1.5B's gate and up projections: 37 MB a layer): kept in the heap, a 512-token prefill took 6-15 %
# less time in runs alternated with the mapped ones (3.70 -> 3.46 s and 3.63 -> 3.10 s, 2-core machine).
HEAP_KEEPS_BYTES = (1 << 30, 32 << 20)  # what is asked for; what older glibc allows (64-bit) where it refuses
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_activations_in_heap() -> bool:
    """Allocations up to 1 GiB come from the heap, and up to that much freed memory stays there for reuse
    (glibc's ``mallopt``; explicit ``malloc_trim`` calls still return it). A thread other than the main one
    allocates from a heap of its own, which glibc caps at 64 MiB: larger allocations there are still mapped.
    Left as it is where the operator set malloc's thresholds (``MALLOC_MMAP_THRESHOLD_``,
    ``MALLOC_TRIM_THRESHOLD_`` or ``glibc.malloc.*`` in ``GLIBC_TUNABLES``) and off glibc; True when set.
    Process-wide, as a preloaded tcmalloc or jemalloc (vLLM-CPU's advice) would be."""
    if any(os.environ.get(name) for name in _MALLOC_ENV) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    for size in HEAP_KEEPS_BYTES:
        if mallopt(m_mmap_threshold, size):
            return bool(mallopt(m_trim_threshold, size))
    return False


HEARTBEAT_S = 5.0  # a start-up stage that runs longer says so this often: a first start on a busy machine is long


@contextlib.contextmanager
def timed_stage(stages: dict[str, float], name: str) -> Iterator[None]:
    """Add the seconds the block takes to ``stages[name]`` (start-up stages, reported in order); while it runs,
    an INFO line every HEARTBEAT_S seconds says which stage the start is in (a kernel compile or a tokenizer
    conversion took 30-50 s of silence on a loaded machine)."""
    t0 = time.perf_counter()
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(HEARTBEAT_S):
            logger.info("starting up: still in the %s stage (%.0f s so far)", name, time.perf_counter() - t0)

    beat = threading.Thread(target=heartbeat, name=f"pagedllm-heartbeat-{name}", daemon=True)
    beat.start()
    try:
        yield
    finally:
        done.set()
        beat.join()
    stages[name] = stages.get(name, 0.0) + time.perf_counter() - t0


_NO_INIT_LOCK = threading.Lock()


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """torch.nn.init's functions as no-ops while a model is built (as transformers' no_init_weights):
    random values the checkpoint overwrites cost a second for SmolLM2. (Building on the meta device
    instead would import torch._dynamo and sympy, over a second more.) Only a loader thread builds
    models, and a lock keeps two builds from interleaving."""
    init = torch.nn.init
    with _NO_INIT_LOCK:  # two engines built at once must not save each other's no-ops as the originals
        saved = {
            name: getattr(init, name)
            for name in dir(init)
            if name.endswith("_") and not name.startswith("_") and callable(getattr(init, name))
        }
        for name in saved:
            setattr(init, name, _return_tensor)
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(init, name, fn)


def _return_tensor(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


def _take_blocks(
    model: LlamaForCausalLM, source: Any, method: str, scheme: Any
) -> tuple[dict[str, Any] | None, set[str]]:
    """Give the layers that can take them the checkpoint's own quantized blocks (a GGUF's Q4 / Q8 groups,
    an AWQ / GPTQ / FP8 checkpoint's), read as they are: no float32 copy of those weights is ever made.
    Returns the blocks by module, and the checkpoint weights the loading then skips."""
    names: list[str] = []  # the checkpoint weights that came as blocks

    def noted(raw: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, block in raw:
            names.append(name)
            yield name, block

    if source.kind == "gguf":  # one tensor's blocks at a time: each fused module's shards go once it is built
        from pagedllm.layers.quantization import GGUF_MODES, gguf_linear_types
        from pagedllm.model_loader.gguf_loader import iter_gguf_blocks

        # the kernels on the file's own blocks: the int8-activation mode, one process (a rank would cut them)
        single = getattr(getattr(model, "ps", None), "world_size", 1) == 1
        native = gguf_linear_types() if method == "gguf" and single else ()
        halves = method in GGUF_MODES and single  # F16 / BF16 matrices as stored: HalfLinear
        blocks = model.quantized_modules(noted(iter_gguf_blocks(source.path, native, halves, method == "gguf")))
    elif scheme is not None:
        from pagedllm.model_loader.hf_loader import iter_raw

        blocks = model.quantized_modules(noted(scheme.read_blocks(iter_raw(source.path)).items()))
    else:
        return None, set()
    _quantize(model, method, blocks, scheme, from_float=False)
    params = dict(model.named_parameters())
    # a weight whose parameter went with its float layer is held already (or not by this stage at all)
    return blocks, {name for name in names if model.weight_target(name) not in params}


def _quantize(
    model: torch.nn.Module, method: str, blocks: dict[str, Any] | None, scheme: Any = None, from_float: bool = True
) -> None:
    from pagedllm.layers.quantization import quantize_fp8, quantize_model

    if method == "fp8":
        quantize_fp8(model, blocks, checkpoint=scheme is not None and scheme.method == "fp8", from_float=from_float)
    else:
        quantize_model(model, method, blocks, from_float=from_float)
