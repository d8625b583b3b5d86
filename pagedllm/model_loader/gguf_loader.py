"""Config and weights of a GGUF file (llama, qwen2, qwen3, gemma3 architectures).

Weights are dequantized with ``gguf`` and renamed to Hugging Face names, so the
models see the same state dict whether they were loaded from GGUF or HF.

Two GGUF quirks matter:

* llama.cpp's converter permutes the rows of Q and K for the ``llama``
  architecture (HF's rotate-half RoPE layout -> GGML's interleaved layout). We
  undo it exactly as ``transformers`` does; qwen2/qwen3 are stored unpermuted.
* There is no ``output.weight`` when the LM head is tied to the embedding.
* Gemma's converter stores each RMSNorm's ``1 + weight``; we give back ``weight``, as transformers does.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import mmap
import os
import re
import struct
import threading
import types
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from pagedllm.errors import UnsupportedModelError
from pagedllm.model_loader import cache
from pagedllm.model_loader.mappings import map_read_only, release

if TYPE_CHECKING:
    import numpy as np
    import torch

    from pagedllm.kernels.ops import GGUFBlocks

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
# Architectures whose Q/K rows llama.cpp permuted on conversion.
_PERMUTED_QK_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3's sandwich norms: its ffn_norm comes before the MLP, and two more follow attention and MLP.
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_NAMES_BY_ARCH = {"gemma3": _GEMMA3_BLOCK_NAMES}
# Architectures whose norms llama.cpp stores as 1 + weight.
_NORM_PLUS_ONE_ARCHITECTURES = ("gemma3",)
# Tensors llama.cpp stores that HF recomputes from the config (llama3 RoPE factors).
_SKIPPED_TENSORS = {"rope_freqs.weight"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face parameter name of a GGUF tensor of architecture ``arch``, or None if unknown."""
    if m := _BLOCK_RE.match(gguf_name):
        layer, part, kind = m.groups()
        names = _BLOCK_NAMES_BY_ARCH.get(arch, _BLOCK_NAMES)
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{kind}"
    elif m := _GLOBAL_RE.match(gguf_name):
        part, kind = m.groups()
        if part in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[part]}.{kind}"
    return None


# ----------------------------------------------------------------------------
# Header scan
#
# gguf.GGUFReader parses every metadata array element into numpy views, which
# takes seconds for a 49k-token vocabulary. Config loading only needs the
# scalar metadata and the tensor names, so we walk the header ourselves and
# skip array bodies. Layout (GGUF v2/v3):
#   magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
#   n_kv  x (string key | u32 type | value)
#   n_tensors x (string name | u32 n_dims | u64 dims[n_dims] | u32 ggml_type | u64 offset)
# where string = u64 length + utf-8 bytes, array = u32 item type + u64 count + items.
# ----------------------------------------------------------------------------

# GGUF metadata value type -> struct format (u8 i8 u16 i16 u32 i32 f32 bool u64 i64 f64).
_SCALAR_FORMATS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """Scalar metadata and tensor shapes of a GGUF file (array values omitted)."""

    metadata: dict[str, str | int | float | bool]
    array_lengths: dict[str, int]
    tensor_shapes: dict[str, tuple[int, ...]]
    """GGUF dims order (innermost first), i.e. reversed from PyTorch's."""
    tensor_types: dict[str, int] = field(default_factory=dict)  # ggml type of each tensor
    tensor_offsets: dict[str, int] = field(default_factory=dict)  # absolute byte offset of each tensor's data

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else "<missing>"


class _Cursor:
    def __init__(self, buf: mmap.mmap, order: str):
        self.buf, self.order, self.pos = buf, order, 0

    def scalar(self, fmt: str) -> int | float | bool:
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(self.order + fmt)
        return value

    def string(self) -> str:
        n = int(self.scalar("Q"))
        if self.pos + n > len(self.buf):
            raise ValueError("string runs past the end of the file")
        s = self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_value(self, vtype: int) -> None:
        if vtype in _SCALAR_FORMATS:
            self.pos += struct.calcsize(self.order + _SCALAR_FORMATS[vtype])
        elif vtype == _STRING:
            # Two statements: `pos += scalar()` would add to pos as it was before scalar() moved it.
            length = int(self.scalar("Q"))
            self.pos += length
        elif vtype == _ARRAY:
            item_type, count = int(self.scalar("I")), int(self.scalar("Q"))
            if item_type in _SCALAR_FORMATS:
                self.pos += count * struct.calcsize(self.order + _SCALAR_FORMATS[item_type])
            elif item_type == _STRING:  # a vocabulary: 150k strings, so one tight loop (struct.error past the end)
                unpack, buf, pos = struct.Struct(self.order + "Q").unpack_from, self.buf, self.pos
                for _ in range(count):
                    pos += 8 + int(unpack(buf, pos)[0])
                self.pos = pos
            else:
                for _ in range(count):
                    self.skip_value(item_type)
        else:
            raise ValueError(f"unknown metadata value type {vtype}")


def read_gguf_header(path: str) -> GGUFHeader:
    """A GGUF file's scalar metadata and tensor shapes (read once per process and file version)."""
    try:
        st = os.stat(path)
    except OSError:
        return _read_gguf_header.__wrapped__(path)  # raises, naming the path
    return _read_gguf_header(os.path.abspath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _read_gguf_header(path: str, mtime_ns: int | None = None, size: int | None = None) -> GGUFHeader:
    """Skips the vocabulary arrays (~0.1 s for SmolLM2's 100k strings); callers must not mutate the result."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise UnsupportedModelError(f"{path!r} is not a GGUF file (bad magic bytes).")
            order = "<"
            (version,) = struct.unpack_from("<I", buf, 4)
            if version & 0xFFFF == 0:  # written on a big-endian machine
                order = ">"
                (version,) = struct.unpack_from(">I", buf, 4)
            if version not in (2, 3):
                raise UnsupportedModelError(f"{path!r} is GGUF version {version}; only versions 2 and 3 are supported.")
            cur = _Cursor(buf, order)
            cur.pos = 8
            n_tensors, n_kv = int(cur.scalar("Q")), int(cur.scalar("Q"))
            metadata: dict[str, str | int | float | bool] = {}
            array_lengths: dict[str, int] = {}
            for _ in range(n_kv):
                key = cur.string()
                vtype = int(cur.scalar("I"))
                if vtype in _SCALAR_FORMATS:
                    metadata[key] = cur.scalar(_SCALAR_FORMATS[vtype])
                elif vtype == _STRING:
                    metadata[key] = cur.string()
                else:
                    start = cur.pos
                    cur.skip_value(vtype)
                    (array_lengths[key],) = struct.unpack_from(order + "Q", buf, start + 4)
            shapes: dict[str, tuple[int, ...]] = {}
            types: dict[str, int] = {}
            offsets: dict[str, int] = {}
            for _ in range(n_tensors):
                name = cur.string()
                n_dims = int(cur.scalar("I"))
                shapes[name] = tuple(int(cur.scalar("Q")) for _ in range(n_dims))
                types[name] = int(cur.scalar("I"))
                offsets[name] = int(cur.scalar("Q"))
            # tensor data starts at the next multiple of the alignment after the header
            align = int(metadata.get("general.alignment", 32))
            data_start = -(-cur.pos // align) * align
            offsets = {name: data_start + off for name, off in offsets.items()}
    except (struct.error, ValueError, OSError) as e:
        if isinstance(e, UnsupportedModelError):
            raise
        raise UnsupportedModelError(f"Could not read the GGUF header of {path!r}: {e}") from e
    return GGUFHeader(
        metadata=metadata, array_lengths=array_lengths, tensor_shapes=shapes, tensor_types=types, tensor_offsets=offsets
    )


def check_supported(arch: str, path: str) -> None:
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} of {path!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}."
        )


# ----------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------


class GGUFModelConfig(types.SimpleNamespace):
    """A GGUF model's config as plain attributes: every field of the transformers config that
    ``AutoConfig(gguf_file=...)`` builds, defaults included.

    Built through transformers once (on a cache miss) and saved whole, it reads back
    without importing transformers' config classes, whose import chain alone costs
    over a second of every start.
    """

    @property
    def name_or_path(self) -> str:
        return self._name_or_path

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def load_gguf_config(path: str) -> GGUFModelConfig:
    """The config of a GGUF, with the values ``AutoConfig(gguf_file=...)`` gives it."""
    header = read_gguf_header(path)
    check_supported(header.architecture, path)

    def build() -> dict[str, Any]:
        from transformers import AutoConfig

        with fast_transformers_gguf_metadata(header.architecture):
            return AutoConfig.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True
            ).to_dict()

    def save(fields: dict[str, Any], entry: str) -> None:
        with open(os.path.join(entry, "config.json"), "w") as f:
            json.dump(fields, f, indent=1, sort_keys=True)

    def load(entry: str) -> dict[str, Any]:
        with open(os.path.join(entry, "config.json")) as f:
            return json.load(f)

    fields = cache.load_or_build("configs", path, build=build, save=save, load=load)
    # JSON object keys are strings; transformers' configs key id2label by int
    fields["id2label"] = {int(k): v for k, v in (fields.get("id2label") or {}).items()}
    config = GGUFModelConfig(**fields)
    # The LM head is tied exactly when the file stores no separate output matrix.
    config.tie_word_embeddings = "output.weight" not in header.tensor_shapes
    config._name_or_path = path
    return config


def gguf_config_dict(metadata: dict[str, Any], tensor_names: tuple[str, ...]) -> dict[str, Any]:
    """The config dict transformers' ``load_gguf_checkpoint`` derives for a llama / qwen2 / qwen3 / gemma3 file.

    Same key mapping, defaults and special cases, but from the metadata of
    transformers' fast reader (``read_gguf_metadata``): the legacy path parses
    every vocabulary string with ``gguf.GGUFReader`` first, which takes seconds.
    Tested equal to ``load_gguf_checkpoint(path)["config"]``.
    """
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = metadata["general.architecture"]
    # transformers tests membership in the list of names: only a file named exactly "mistral"
    updated = "mistral" if "llama" in arch and metadata.get("general.name") == "mistral" else arch
    config: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, default in (
        GGUF_CONFIG_DEFAULTS_MAPPING.get(updated) or GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}
    ).items():
        config.setdefault(key, default)
    # section -> {its key: the config field}; the values' inferred type is too wide to index
    mapping = cast("dict[str, dict[str, Any]]", GGUF_CONFIG_MAPPING)
    for key, value in metadata.items():
        prefix, _, config_key = key.replace(arch, updated).partition(".")
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, updated)
        renamed = mapping.get(prefix, {}).get(config_key)
        if renamed is not None and renamed != -1:
            config[renamed] = value
    config.setdefault("vocab_size", metadata.get("tokenizer.ggml.tokens"))  # the reader gives its length
    if config.get("model_type") == "gemma3":  # its one special case there: a GGUF holds only the text model
        config["model_type"] = "gemma3_text"
    return config


_FAST_METADATA_LOCK = threading.Lock()
# gguf_config_dict follows transformers' generic path and its special cases for these: the legacy path takes 17 s
# on Gemma 3's 262,144-token vocabulary (before the tokenizer's conversion reads it once more)
_FAST_CONFIG_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")


@contextlib.contextmanager
def fast_transformers_gguf_metadata(arch: str) -> Iterator[None]:
    """While transformers builds a config or tokenizer from one of our GGUF architectures, let it read
    the config through :func:`gguf_config_dict` (its fast path) instead of its legacy full parse."""
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS

    with _FAST_METADATA_LOCK:
        added = arch in _FAST_CONFIG_ARCHITECTURES and arch not in GGUF_CONFIG_ARCHS
        if added:
            GGUF_CONFIG_ARCHS[arch] = gguf_config_dict
        try:
            yield
        finally:
            if added:
                GGUF_CONFIG_ARCHS.pop(arch, None)


# ----------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------


# the block types the GGUF modes keep as stored (:func:`_q_blocks`); plain float tensors are taken as they are
STORED_BLOCK_TYPES = (
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_NL",
    "IQ4_XS",
)
_PLAIN_TYPES = ("F32", "F16", "BF16", "F64")


def _ggml_type(header: GGUFHeader, name: str, path: str) -> Any:
    """Tensor ``name``'s ``gguf.GGMLQuantizationType``; a clear error for a type the gguf package does not know."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(header.tensor_types[name])
    except ValueError:
        raise UnsupportedModelError(
            f"GGUF tensor {name!r} in {path!r} has unknown ggml type {header.tensor_types[name]}"
        ) from None


def check_gguf_tensors(path: str, as_stored: bool = False) -> None:
    """Before anything loads: every tensor's data lies within the file (else it is truncated), and, ``as_stored``
    (the GGUF modes), every tensor's type has a kernel; one error naming the file, the tensor and the setting."""
    from gguf import GGML_QUANT_SIZES

    header = read_gguf_header(path)
    size = os.path.getsize(path)
    no_kernel: dict[str, str] = {}
    for name, dims in header.tensor_shapes.items():
        qtype = _ggml_type(header, name, path)
        block, type_size = GGML_QUANT_SIZES[qtype]
        end = header.tensor_offsets[name] + math.prod(dims) // block * type_size
        if end > size:
            raise UnsupportedModelError(
                f"{path!r} is truncated: tensor {name!r} ends at byte {end:,} but the file has {size:,} bytes "
                "(an interrupted download or copy?)"
            )
        if qtype.name not in STORED_BLOCK_TYPES + _PLAIN_TYPES and name not in _SKIPPED_TENSORS:
            no_kernel[name] = qtype.name
    if as_stored and no_kernel:
        first = next(iter(no_kernel))
        raise UnsupportedModelError(
            f"{path!r} holds {len(no_kernel)} tensor(s) in block types pagedllm has no kernel for "
            f"({', '.join(sorted(set(no_kernel.values())))}, e.g. {first!r}); kernels exist for "
            f"{', '.join(STORED_BLOCK_TYPES)}. Load it with quantization='none' to widen every weight to float, "
            "or with quantization='int4' / 'int8' to round them again."
        )


def all_in_panels(path: str) -> bool:
    """Whether the int8 kernels hold every quantized tensor of the file in panels of 16 rows on this CPU
    (``GGUFBlocks.pack``: the K-quants, and the types of 32-blocks of a multiple of 64 columns, with whole panels
    of rows, AVX2 and AVX-512 VNNI), where every row count runs one kernel: Q4_K_M files such as Qwen2.5's are, and
    the embedded SmolLM2's Q4_1; files with a type that has none (the other i-quants) are not, nor files of float
    tensors only (F16: no integer arithmetic to run), but where the CPU has AVX512_BF16 a BF16 matrix counts
    (bfloat16 dot products, llama.cpp's arithmetic for it)."""
    from pagedllm import kernels
    from pagedllm.kernels.ops import fits_panels

    header = read_gguf_header(path)
    found = kernels.try_load()
    bf16_dot = found is not None and found.gguf.has_bf16_dot
    quantized = False
    for name, dims in header.tensor_shapes.items():
        qtype = _ggml_type(header, name, path)
        if name in _SKIPPED_TENSORS:
            continue
        if bf16_dot and qtype.name == "BF16" and len(dims) == 2:
            quantized = True  # bfloat16 dot products (HalfLinear), one kernel at every row count
            continue
        if qtype.name in _PLAIN_TYPES:
            continue
        if len(dims) != 2 or not fits_panels(int(qtype), dims[1], dims[0]):  # dims: (columns, rows)
            return False
        quantized = True
    return quantized and found is not None and found.gguf.has_panels


def reverse_llama_qk_permutation(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K rows (same as transformers' GGUF loader).

    llama.cpp: ``w.reshape(n_head, 2, d // n_head // 2, ...).swapaxes(1, 2)``.
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _iter_raw_tensors(path: str) -> Iterator[tuple[str, str, Any, np.ndarray, Callable[[np.ndarray], np.ndarray]]]:
    """Yield ``(name_in_file, hf_name, qtype, raw rows, unpermute)`` per tensor, straight from a memory map.

    Tensor data is read at the offsets our header scan found; gguf.GGUFReader
    would first spend seconds parsing the vocabulary. ``unpermute`` undoes
    llama.cpp's Q/K row permutation (and takes the one off Gemma's norms; identity
    for other tensors); it applies to anything with one entry per output row.
    """
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    header = read_gguf_header(path)
    arch = header.architecture
    check_supported(arch, path)
    check_gguf_tensors(path)
    n_head = n_head_kv = 0
    if arch in _PERMUTED_QK_ARCHITECTURES:
        n_head = int(header.metadata[f"{arch}.attention.head_count"])
        n_head_kv = int(header.metadata.get(f"{arch}.attention.head_count_kv", n_head))
    mapping = map_read_only(path)
    file = np.frombuffer(mapping, dtype=np.uint8)
    plain = {
        GGMLQuantizationType.F32: np.float32,
        GGMLQuantizationType.F16: np.float16,
        GGMLQuantizationType.F64: np.float64,
    }
    for name_in_file, dims in header.tensor_shapes.items():
        qtype = _ggml_type(header, name_in_file, path)
        if name_in_file in _SKIPPED_TENSORS:
            continue
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = int(np.prod(dims)) * type_size // block
        start = header.tensor_offsets[name_in_file]
        raw = file[start : start + n_bytes]
        if qtype in plain:  # stored as-is, in PyTorch's (reversed) dim order
            data = raw.view(plain[qtype]).reshape(tuple(reversed(dims)))
        else:  # rows of quantized blocks, as gguf.quants.dequantize expects them
            data = raw.reshape(*reversed(dims[1:]), dims[0] // block * type_size)
        name = hf_name(name_in_file, arch)
        if name is None:
            raise UnsupportedModelError(
                f"GGUF tensor {name_in_file!r} in {path!r} has no Hugging Face equivalent for architecture {arch!r}."
            )
        heads = 0
        if arch in _PERMUTED_QK_ARCHITECTURES:
            heads = n_head if ".attn_q." in name_in_file else n_head_kv if ".attn_k." in name_in_file else 0
        fix = _identity
        if heads:
            fix = functools.partial(reverse_llama_qk_permutation, n_head=heads)
        elif arch in _NORM_PLUS_ONE_ARCHITECTURES and name.endswith("norm.weight"):
            fix = _minus_one
        yield name_in_file, name, qtype, data, fix
        release(mapping, start, n_bytes)


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def _minus_one(x: np.ndarray) -> np.ndarray:
    return x - 1


def iter_gguf_weights(path: str, skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor [out, in])``, dequantizing one tensor at a time; the names in
    ``skip`` are passed over, never dequantized (their layers took the file's blocks as they are).

    Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K blocks are widened by torch
    (multi-threaded, the same float32 values as ``gguf.quants.dequantize``,
    several times faster); other types go through ``gguf``.
    """
    import numpy as np
    import torch
    from gguf.quants import dequantize

    for name_in_file, name, qtype, data, unpermute in _iter_raw_tensors(path):
        if name in skip:
            continue
        block = _q_blocks(data, qtype, unpermute)
        if block is not None:
            yield name, _widen(*block)
            continue
        try:
            w = dequantize(data, qtype)
        except NotImplementedError as e:
            raise UnsupportedModelError(
                f"GGUF tensor {name_in_file!r} in {path!r} uses quantization {qtype.name}, "
                "which the gguf package cannot dequantize."
            ) from e
        w = unpermute(w)
        # plain tensors come back as read-only views of the file mapping: copy those
        w = np.array(w, dtype=np.float32) if not w.flags.writeable else np.ascontiguousarray(w, dtype=np.float32)
        yield name, torch.from_numpy(w)


def gguf_quantized_blocks(path: str) -> dict[str, tuple[str, tuple[torch.Tensor, ...]]]:
    """The tensors of a GGUF file whose blocks fit pagedllm's int4 / int8 layouts, in them, by HF name
    (Q4_0 / Q4_1 / Q8_0 as below; Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K: see :func:`_q_blocks`).

    GGUF blocks are 32 weights. Q4_1 stores (d, m) as float16 then 16 bytes of
    nibbles (w = q*d + m); Q4_0 stores d then the nibbles (w = (q - 8)*d); Q8_0
    stores d then 32 int8 (w = q*d). These are exactly our layouts
    (:mod:`pagedllm.layers.quantization`), so no weight is rounded twice:
    ``("int4", (packed [N, K/2] uint8, scales [N, K/32], mins))`` or
    ``("int8", (int8 [N, K], scales [N, K/32], mins = 0))``.
    """
    return dict(iter_gguf_blocks(path))


def iter_gguf_blocks(
    path: str, native: Collection[str] = (), halves: bool = False, bf16_panels: bool = False
) -> Iterator[tuple[str, tuple[str, tuple[torch.Tensor, ...]]]]:
    """:func:`gguf_quantized_blocks` one tensor at a time, each converted in slices of rows (a 150k-token
    vocabulary's temporaries stay small). Tensors of a type named in ``native`` (``"Q4_K"``, ``"Q6_K"``; the others
    only where they fit panels: ``fits_panels``, whose kernels are the only ones that beat our groups for Q8_0 /
    Q5_0, and the only ones for the rest) come as the file stores them instead, nothing converted or
    copied: ``(type name, (rows,))``, ``rows`` a uint8 view [N, bytes a row] of a read-only mapping of the file
    (the kernels of :class:`~pagedllm.layers.gguf_linear.GGUFLinear` read them there; the page cache holds them
    once for every process that maps the file). A row permutation (llama's Q / K) makes those a copy of the rows.
    ``halves``: F16 and BF16 matrices come as stored too, ``("F16" | "BF16", (weight,))``, ``weight`` a float16 /
    bfloat16 tensor [N, K] on the mapping (:class:`~pagedllm.layers.gguf_linear.HalfLinear` reads them there);
    with ``bf16_panels`` (the "gguf" mode) a BF16 one comes repacked for bfloat16 dot products where the CPU has them,
    ``("BF16P", (panels,))`` (``GGUFBlocks.pack_bf16``: a copy, so only one tensor's file pages are read at a time)."""
    import warnings

    import numpy as np
    import torch

    from pagedllm.kernels.ops import _BLOCK_SIZES, fits_panels
    from pagedllm.layers.quantization import HALF_GGUF_TYPES

    for _, name, qtype, data, unpermute in _iter_raw_tensors(path):
        half = halves and qtype.name in HALF_GGUF_TYPES and data.ndim == 2
        stored = half or (qtype.name in native and data.ndim == 2)
        if stored and not half and qtype.name not in ("Q4_K", "Q6_K"):  # the others only where they fit panels
            elems, size = _BLOCK_SIZES[int(qtype)]
            stored = fits_panels(int(qtype), data.shape[0], data.shape[1] // size * elems)
        if stored:
            rows = unpermute(data)
            with warnings.catch_warnings():  # a read-only mapping: nothing writes to the weights
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(np.ascontiguousarray(rows))  # the mapping's own bytes when they are in order
            if half:  # F16 comes as float16 already, BF16 as its bytes
                raw = raw.view(torch.float16 if qtype.name == "F16" else torch.bfloat16)
                # not the embedding: a table of its own is only looked up (its rows stay in the file's mapping, read
                # as asked), and a tied head packs it as it is built
                k = _group_kernels() if bf16_panels and qtype.name == "BF16" and "embed_tokens" not in name else None
                panels = None if k is None else k.pack_bf16(raw)
                if panels is not None:
                    yield name, ("BF16P", (panels,))
                    continue
            yield name, (qtype.name, (raw,))
            continue
        block = _q_blocks_in_slices(data, qtype, unpermute)
        if block is not None:
            yield name, block


def converted_block(kind: str, raw: torch.Tensor) -> tuple[str, tuple[torch.Tensor, ...]]:
    """A native block of :func:`iter_gguf_blocks` (``kind`` its type name) in pagedllm's int4 / int8 layout,
    for a fused linear whose other shards are in that layout."""
    from gguf import GGMLQuantizationType

    block = _q_blocks(raw.numpy(), GGMLQuantizationType[kind], _identity)
    assert block is not None  # every native type has a layout
    return block


_SLICE_ROWS = 4096


def _q_blocks_in_slices(
    data: np.ndarray, qtype: Any, unpermute: Callable[[np.ndarray], np.ndarray]
) -> tuple[str, tuple[torch.Tensor, ...]] | None:
    """:func:`_q_blocks` of ``data`` converted ``_SLICE_ROWS`` rows at a time into tensors allocated once
    (a row permutation needs the whole tensor: those are the small Q / K projections)."""
    import torch

    from pagedllm.kernels.ops import GROUP_LAYOUTS

    n = data.shape[0]
    in_c = int(qtype) in GROUP_LAYOUTS and _group_kernels() is not None  # C: no temporaries
    if n <= _SLICE_ROWS or unpermute is not _identity or in_c:
        return _q_blocks(data, qtype, unpermute)
    first = _q_blocks(data[:_SLICE_ROWS], qtype, unpermute)
    if first is None:
        return None
    kind, parts = first
    out = tuple(torch.empty((n, *t.shape[1:]), dtype=t.dtype) for t in parts)
    for o, t in zip(out, parts, strict=True):
        o[:_SLICE_ROWS].copy_(t)
    for start in range(_SLICE_ROWS, n, _SLICE_ROWS):
        _, piece = cast(
            "tuple[str, tuple[torch.Tensor, ...]]", _q_blocks(data[start : start + _SLICE_ROWS], qtype, unpermute)
        )
        for o, t in zip(out, piece, strict=True):
            o[start : start + t.shape[0]].copy_(t)
    return kind, out


def _group_kernels() -> GGUFBlocks | None:
    """gguf_blocks.c's conversion, where the C kernels can be built (else None: numpy converts)."""
    from pagedllm import kernels

    k = kernels.try_load()
    return None if k is None else k.gguf


def _q_blocks(
    data: np.ndarray, qtype: Any, unpermute: Callable[[np.ndarray], np.ndarray]
) -> tuple[str, tuple[torch.Tensor, ...]] | None:
    """:func:`_q_blocks_numpy`, bit for bit, by gguf_blocks.c's ``gguf_to_groups`` where the kernels can be
    built: one pass at about the memory's speed, with no temporaries (numpy took 5.9 s of the 1.5B's load, C 1.0 s)."""
    import numpy as np

    from pagedllm.kernels.ops import GROUP_LAYOUTS

    k = _group_kernels() if int(qtype) in GROUP_LAYOUTS else None
    if k is None:
        return _q_blocks_numpy(data, qtype, unpermute)
    n = data.shape[0]
    return k.to_groups(int(qtype), np.ascontiguousarray(unpermute(np.asarray(data))).reshape(n, -1))


def _q_blocks_numpy(
    data: np.ndarray, qtype: Any, unpermute: Callable[[np.ndarray], np.ndarray]
) -> tuple[str, tuple[torch.Tensor, ...]] | None:
    """One quantized tensor's rows of blocks in pagedllm's int4 / int8 layout (groups of 32 with a float32
    scale and min each, ``w = q * scale + min``), exactly the values ``gguf`` dequantizes them to; None for
    types that do not fit (the i-quants but IQ4_NL / IQ4_XS): those are dequantized. Q2_K / Q3_K / IQ4_NL / IQ4_XS:
    see :func:`_q_blocks_lookup`.

    Q4_0 / Q4_1 / Q8_0 are such groups already. Q5_0 / Q5_1 are 5-bit groups of 32 (int8). The K-quants
    Q4_K / Q5_K are super-blocks of 256: eight groups of 32 whose 6-bit scale and min multiply the
    super-block's float16 ``d`` and ``dmin`` (``w = d*sc * q - dmin*m``), int4 and int8 respectively.
    Q6_K's super-blocks hold sixteen groups of 16 with an int8 scale each (``w = d*sc * (q - 32)``):
    int8 with a scale per 16 (scales [N, K/16]; the mins, all 0, per 32)."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as T

    if qtype in (T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS):
        return _q_blocks_lookup(unpermute(np.asarray(data)), qtype)
    if qtype not in (T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K):
        return None

    def f16(raw: np.ndarray) -> np.ndarray:
        return raw.copy().view(np.float16)[..., 0].astype(np.float32)

    n = data.shape[0]
    rows = unpermute(np.asarray(data))
    if qtype == T.Q6_K:  # ql [128], qh [64], scales [16] int8, d: two halves of 128 elements each
        blocks = rows.reshape(n, -1, 210)
        ql = blocks[..., :128].reshape(n, -1, 2, 2, 32)  # [half, ql[l] | ql[l + 32], l]
        qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32)
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=3)  # elements l, l + 32, l + 64, l + 96 of a half
        high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
        q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, -1)
        sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
        scales = (f16(blocks[..., 208:210])[..., None] * sc).reshape(n, -1)
        return "int8", (torch.from_numpy(q), torch.from_numpy(scales), torch.zeros(n, q.shape[1] // 32))
    if qtype in (T.Q4_K, T.Q5_K):
        blocks = rows.reshape(n, -1, 144 if qtype == T.Q4_K else 176)
        sc, m = _k_scale_min(blocks[..., 4:16])  # [n, super-blocks, 8]
        scales = (f16(blocks[..., 0:2])[..., None] * sc.astype(np.float32)).reshape(n, -1)
        mins = -(f16(blocks[..., 2:4])[..., None] * m.astype(np.float32)).reshape(n, -1)
        qs = blocks[..., -128:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
        q = (qs & 0x0F).reshape(n, -1, 32)  # group 2j: chunk j's low nibbles; group 2j + 1: its high ones
        if qtype == T.Q5_K:  # bit s of byte l is the fifth bit of element l of group s
            qh = blocks[..., 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
            q = q | ((qh & 1).reshape(n, -1, 32) << 4)
            return "int8", (
                torch.from_numpy(q.reshape(n, -1).view(np.int8)),
                torch.from_numpy(scales),
                torch.from_numpy(mins),
            )
        packed = q[..., :16] | (q[..., 16:] << 4)  # our int4 byte j: element j low, element j + 16 high
        return "int4", (
            torch.from_numpy(np.ascontiguousarray(packed).reshape(n, -1)),
            torch.from_numpy(scales),
            torch.from_numpy(mins),
        )
    if qtype in (T.Q5_0, T.Q5_1):
        head = 2 if qtype == T.Q5_0 else 4
        blocks = rows.reshape(n, -1, head + 20)
        d = f16(blocks[..., 0:2])
        qh = blocks[..., head : head + 4].copy().view("<u4")  # [n, groups, 1]: bit j is element j's fifth bit
        qs = blocks[..., head + 4 :]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)
        q |= ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16) << 4
        if qtype == T.Q5_0:
            q -= 16  # w = d * (q - 16)
            m = np.zeros_like(d)
        else:
            m = f16(blocks[..., 2:4])  # w = d * q + m
        return "int8", (torch.from_numpy(q.astype(np.int8).reshape(n, -1)), torch.from_numpy(d), torch.from_numpy(m))

    head = {T.Q4_1: 4, T.Q4_0: 2, T.Q8_0: 2}[qtype]
    blocks = rows.reshape(n, -1, head + (32 if qtype == T.Q8_0 else 16))
    d = f16(blocks[..., 0:2])
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., head:]).reshape(n, -1))
    if qtype == T.Q8_0:
        return "int8", (q.view(torch.int8), torch.from_numpy(d), torch.zeros(d.shape))
    m = f16(blocks[..., 2:4]) if qtype == T.Q4_1 else -8 * d
    return "int4", (q, torch.from_numpy(d), torch.from_numpy(m))


def _q_blocks_lookup(rows: np.ndarray, qtype: Any) -> tuple[str, tuple[torch.Tensor, ...]]:
    """Q2_K, Q3_K, IQ4_NL and IQ4_XS in pagedllm's int8 layout, the values ``gguf`` dequantizes them to (its
    ``dequantize_blocks``, whose products these are), mins 0 but Q2_K's:

    * Q2_K: 84 bytes / 256: sixteen bytes of a 4-bit scale (low) and min (high) per 16, qs[64], f16 d and dmin;
      element 128h + 32j + l is bits 2j of qs[32h + l]; w = (d * sc) * q - dmin * m: int8 with a scale and a
      min per 16, q 0..3.

    * Q3_K: 110 bytes / 256: hmask[32], qs[64], 12 bytes of sixteen 6-bit scales, f16 d; element 128h + 32j + l
      is bits 2j of qs[32h + l] minus 4 where bit 4h + j of hmask[l] is clear; w = (d * (sc - 32)) * q per 16:
      int8 with a scale per 16, q -4..3.
    * IQ4_NL: 18 bytes / 32: f16 d, 16 bytes of nibbles (element j low, j + 16 high), each an index into the
      16 int8 values of ``IQ4_NL.kvalues``; w = d * kvalues[i]: int8 q = kvalues[i], scale d.
    * IQ4_XS: 136 bytes / 256: f16 d, u16 of the scales' top two bits (2 per sub-block of 32), 4 bytes of their
      low nibbles (sub-block 2i low, 2i + 1 high), then IQ4_NL's nibbles per sub-block;
      w = (d * (ls - 32)) * kvalues[i]: q = kvalues[i], a scale per 32."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as T
    from gguf.quants import IQ4_NL

    def f16(raw: np.ndarray) -> np.ndarray:
        return raw.copy().view(np.float16)[..., 0].astype(np.float32)

    n = rows.shape[0]
    kvalues = np.array(IQ4_NL.kvalues, dtype=np.int8)
    if qtype == T.Q2_K:
        blocks = rows.reshape(n, -1, 84)
        sc = blocks[..., :16]
        scales = (f16(blocks[..., 80:82])[..., None] * (sc & 0x0F).astype(np.float32)).reshape(n, -1)
        mins = -(f16(blocks[..., 82:84])[..., None] * (sc >> 4).astype(np.float32)).reshape(n, -1)
        q = (blocks[..., 16:80].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
        return "int8", (
            torch.from_numpy(q.reshape(n, -1).view(np.int8)),
            torch.from_numpy(scales),
            torch.from_numpy(mins),
        )
    if qtype == T.Q3_K:
        blocks = rows.reshape(n, -1, 110)
        packed = blocks[..., 96:108]
        low = (packed[..., None, :8] >> np.array([0, 4], np.uint8).reshape(2, 1)).reshape(*packed.shape[:2], 16)
        high = (packed[..., None, 8:] >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)).reshape(*packed.shape[:2], 16)
        sc = ((low & 0x0F) | ((high & 3) << 4)).astype(np.int8) - np.int8(32)
        scales = (f16(blocks[..., 108:110])[..., None] * sc.astype(np.float32)).reshape(n, -1)
        shifts = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        ql = (blocks[..., 32:96].reshape(n, -1, 2, 1, 32) >> shifts) & 3  # [n, blocks, half, j, l]
        qh = (blocks[..., None, :32] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # [n, blocks, 4h + j, l]
        q = ql.reshape(n, -1).astype(np.int8) - ((qh.reshape(n, -1) ^ 1) << 2).astype(np.int8)
        return "int8", (torch.from_numpy(q), torch.from_numpy(scales), torch.zeros(n, q.shape[1] // 32))
    nibbles = np.array([0, 4], np.uint8).reshape(2, 1)
    if qtype == T.IQ4_NL:
        blocks = rows.reshape(n, -1, 18)
        scales = f16(blocks[..., 0:2])
        idx = (blocks[..., None, 2:] >> nibbles) & 0x0F  # [n, blocks, low / high, 16]
    else:
        blocks = rows.reshape(n, -1, 136)
        ls_low = ((blocks[..., 4:8, None] >> np.array([0, 4], np.uint8)) & 0x0F).reshape(n, -1, 8)
        ls_high = (blocks[..., 2:4].copy().view("<u2") >> (2 * np.arange(8, dtype=np.uint16))) & 3
        ls = (ls_low | (ls_high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
        scales = (f16(blocks[..., 0:2])[..., None] * ls.astype(np.float32)).reshape(n, -1)
        idx = (blocks[..., 8:].reshape(n, -1, 8, 1, 16) >> nibbles) & 0x0F  # [n, blocks, sub-block, low / high, 16]
    q = kvalues[idx.reshape(n, -1)]
    return "int8", (torch.from_numpy(q), torch.from_numpy(np.ascontiguousarray(scales)), torch.zeros(scales.shape))


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of a K-quant super-block, from its 12 bytes (llama.cpp's
    ``get_scale_min_k4``): groups 0-3 in the low six bits of bytes 0-3 / 4-7; groups 4-7 take their low
    four bits from bytes 8-11 and their top two from the spare bits of bytes 0-3 / 4-7."""
    import numpy as np

    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _widen(kind: str, block: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """float32 [N, K] of blocks from :func:`_q_blocks`: ``q * scale + min`` (a scale per 32 or per 16, a min
    per 32 or per 16)."""
    from pagedllm.layers.quantization import widen_int4

    q, scales, mins = widen_int4(*block) if kind == "int4" else block  # one byte per weight
    n, k = q.shape
    w = q.view(n, scales.shape[1], -1).float().mul_(scales[..., None]).view(n, mins.shape[1], -1).add_(mins[..., None])
    return w.view(n, k)
