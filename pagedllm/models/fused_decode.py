"""A decode step's layer loop in one C call (``pagedllm/kernels/decode_loop.c``).

Single-stream decode on a CPU runs ~120 kernels a token of tens of microseconds each; the Python
between them (module calls, views, tensor allocations, ctypes argument conversion) cost about a third
of the step. When a Llama-family model's every projection runs on our kernels (the quantized linears
of ``--quantization int8 / int4 / w4a8 / w4a16``, or float32 ones for up to ``GEMV_ROWS`` rows) and
every row of a step is a decode, the loop runs in C instead, calling the same kernels on the same inputs
in the same order, so the logits are the Python loop's bit for bit. Anything else (prefill, LoRA or
unpacked linears, q/k norms, MoE blocks, tensor or pipeline parallelism, KV caches other than float32
and bfloat16, more rows than the kernels take) runs the Python loop, and so does every step under
``enforce_eager=True``.

The plan keeps the pointers of every weight; before each step it checks that the modules it read
them from are still the model's (a test or an adapter may swap a linear), else it rebuilds.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from pagedllm import kernels
from pagedllm.attention import AttentionMetadata, cpu_paged, kv_int8
from pagedllm.layers.linear import GEMV_ROWS
from pagedllm.layers.quantization import SMALL_BATCH


class _QLinear(ctypes.Structure):
    pass


_QLinear._fields_ = [
    ("qweight", ctypes.c_void_p),
    ("scales", ctypes.c_void_p),
    ("mins", ctypes.c_void_p),
    ("bias", ctypes.c_void_p),
    ("n", ctypes.c_int64),
    ("k", ctypes.c_int64),
    ("kind", ctypes.c_int64),
    ("parts", ctypes.POINTER(_QLinear)),
    ("n_parts", ctypes.c_int64),
]
_GGUF_A8, _GGUF_F32 = 100, 400  # decode_loop.c's kinds of a GGUF's blocks as stored: + the ggml type (or repacked's)


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _QLinear),
        ("o", _QLinear),
        ("gate_up", _QLinear),
        ("down", _QLinear),
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("sliding_window", ctypes.c_int64),
        ("kv_dtype", ctypes.c_int64),
    ]


# the KV cache dtypes the C loop writes (decode_loop.c's store_kv); it reads them by kernels.KV_DTYPES' codes
_KV_WRITTEN = (torch.float32, torch.bfloat16, torch.int8)


def _linear(lin: Any, keep: list[Any]) -> _QLinear:
    """The C loop's view of a linear; arrays it points to are appended to ``keep`` (they must outlive it)."""
    from pagedllm.layers.gguf_linear import GGUFLinear, StackedLinear

    bias = lin.bias.data_ptr() if lin.bias is not None else None
    if isinstance(lin, StackedLinear):
        parts = (_QLinear * len(lin.parts))(*(_linear(p, keep) for p in lin.parts))
        keep.append(parts)
        return _QLinear(None, None, None, bias, lin.out_features, lin.in_features, 0, parts, len(lin.parts))
    if isinstance(lin, GGUFLinear):
        kind = (_GGUF_A8 if lin.activation_bits else _GGUF_F32) + lin.qtype
        return _QLinear(lin.raw.data_ptr(), None, None, bias, lin.out_features, lin.in_features, kind)
    if not hasattr(lin, "qweight"):  # PackedLinear: its float32 panels
        return _QLinear(lin.panels.data_ptr(), None, None, bias, lin.out_features, lin.in_features, 4)
    kind = 5 if lin.scales_per_group == 2 else (0 if lin.bits == 4 else 1) + {None: 0, 8: 2, 16: 6}[lin.activation_bits]
    mins = lin.mins.data_ptr() if lin.mins is not None else None  # None: all 0, not kept
    return _QLinear(lin.qweight.data_ptr(), lin.scales.data_ptr(), mins, bias, lin.out_features, lin.in_features, kind)


def _modules(model: Any) -> list[Any]:
    """Every module the C loop reads, in a fixed order: what must stay the same between steps."""
    mods: list[Any] = [model.norm, model.rotary]
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        mods += [
            layer,
            a,
            m,
            a.qkv_proj,
            a.o_proj,
            getattr(m, "gate_up_proj", None),
            getattr(m, "down_proj", None),
            layer.input_layernorm,
            layer.post_attention_layernorm,
            a.attn,
        ]  # an MoE block has no projections
    return mods


def _eligible(model: Any) -> bool:
    """Does the C loop compute exactly this model's forward (given a decode-only step)?"""
    from pagedllm.layers.gguf_linear import GGUFLinear, StackedLinear
    from pagedllm.layers.linear import PackedLinear
    from pagedllm.layers.mlp import GatedMLP
    from pagedllm.layers.norm import RMSNorm
    from pagedllm.layers.quantization import Int4Linear, Int8Linear
    from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

    if (
        type(model).forward is not LlamaForCausalLM.forward
        or model.ps.world_size > 1
        or model.aux_hidden_state_layers
        or not len(model.layers)
        or type(model.norm) is not RMSNorm
        or model.embed_tokens is None
        or kernels.try_load() is None
    ):
        return False
    eps = model.norm.eps
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        if type(m) is not GatedMLP:  # an MoE block
            return False
        linears = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
        if (
            type(layer).forward is not LlamaDecoderLayer.forward
            or type(a).forward is not LlamaAttention.forward
            or a.q_norm is not None
            or a.attn is not cpu_paged.paged_attention
            or a.kv_group  # a local layer with a block table of its own (kv_groups)
            or any(
                type(lin) not in (Int4Linear, Int8Linear, PackedLinear, GGUFLinear, StackedLinear) for lin in linears
            )
            or any(type(p) is not GGUFLinear for lin in linears if type(lin) is StackedLinear for p in lin.parts)
            or any(type(lin) is PackedLinear and lin.panels is None for lin in linears)
            or any(
                type(n) is not RMSNorm or n.eps != eps or n.weight.dtype != torch.float32
                for n in (layer.input_layernorm, layer.post_attention_layernorm)
            )
        ):
            return False
    return True


def _is_gguf(lin: Any) -> bool:
    from pagedllm.layers.gguf_linear import GGUFLinear, StackedLinear

    return isinstance(lin, GGUFLinear | StackedLinear)


class FusedDecode:
    """Runs a decode-only step's layers in C for a model :func:`_eligible` accepts; see the module doc."""

    def __init__(self, model: Any):
        self.model = model
        self.steps = 0  # decode steps the C loop ran (tests read it)
        self._mods: list[Any] | None = None
        self._caches: list[torch.Tensor] | None = None
        self._layers: Any = None
        self._max_rows: float = 0
        self._keep: list[Any] = []  # the ctypes arrays the layers point to (a stacked linear's parts)

    def _build(self, kv_caches: list[torch.Tensor]) -> bool:
        model = self.model
        self._mods, self._caches, self._layers = _modules(model), list(kv_caches), None
        if not _eligible(model):
            return False
        a0 = model.layers[0].self_attn
        for cache in kv_caches:
            if (
                cache.dtype not in _KV_WRITTEN
                or not cache.is_contiguous()
                or cache.shape[3] != a0.num_kv_heads
                or kv_int8.head_dim(cache) != a0.head_dim
                or not cpu_paged.kernel_applies(torch.empty(1, a0.num_heads, a0.head_dim), cache)
            ):
                return False
        layers = (_Layer * len(model.layers))()
        rows: list[float] = []
        keep: list[Any] = []
        for out, layer, cache in zip(layers, model.layers, kv_caches):
            a, m = layer.self_attn, layer.mlp
            for field, lin in (
                ("qkv", a.qkv_proj),
                ("o", a.o_proj),
                ("gate_up", m.gate_up_proj),
                ("down", m.down_proj),
            ):
                setattr(out, field, _linear(lin, keep))
                rows.append(getattr(lin, "_small_batch", SMALL_BATCH if _is_gguf(lin) else GEMV_ROWS))
            out.input_norm = layer.input_layernorm.weight.data_ptr()
            out.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            out.k_cache, out.v_cache = cache[0].data_ptr(), cache[1].data_ptr()
            out.sliding_window = a.sliding_window or 0
            out.kv_dtype = kernels.KV_DTYPES[cache.dtype]
        self._layers, self._max_rows, self._keep = layers, min(rows), keep
        return True

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """The final hidden states [T, hidden], or None where this step must run the Python loop."""
        t = input_ids.shape[0]
        if meta.num_decodes != t or t == 0:
            return None
        if (
            self._mods is None
            or self._caches is None  # set with _mods
            or len(kv_caches) != len(self._caches)
            or any(a is not b for a, b in zip(kv_caches, self._caches))
            or any(a is not b for a, b in zip(_modules(self.model), self._mods))
        ):
            self._build(kv_caches)
        if self._layers is None or t > self._max_rows:
            return None
        model, a0 = self.model, self.model.layers[0].self_attn
        x = model.embed_tokens(input_ids)
        if x.dtype != torch.float32:
            return None
        x = x.contiguous()
        cos, sin = model.rotary.cos_sin(positions)
        out = torch.empty_like(x)
        seq_lens = meta.seq_lens[:t].contiguous()
        rc = kernels.load().decode_layers(
            self._layers,
            len(model.layers),
            x,
            out,
            t,
            x.shape[1],
            a0.num_heads,
            a0.num_kv_heads,
            a0.head_dim,
            model.layers[0].mlp.intermediate,
            model.norm.eps,
            model.norm.weight,
            cos.contiguous(),
            sin.contiguous(),
            meta.slot_mapping.contiguous(),
            meta.block_tables,
            seq_lens,
            kv_caches[0].shape[2],
            a0.scale,
        )
        if rc != 0:
            raise MemoryError("the C decode loop could not allocate its buffers")
        self.steps += 1
        return out
