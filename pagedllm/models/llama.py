"""The Llama family, config-driven: Llama 2/3, Mistral, Qwen2 (QKV bias), Qwen3 (q/k norm), SmolLM2, and the
Mixture-of-Experts members Mixtral, Qwen2-MoE (shared expert) and Qwen3-MoE (their sparse blocks in
:mod:`pagedllm.layers.fused_moe`).

Projections are fused (q|k|v and gate|up) so each layer runs two big matmuls
instead of five; :meth:`LlamaForCausalLM.load_weights` maps transformers'
separate tensors into the fused ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention import AttentionMetadata, get_attention_backend
from pagedllm.distributed import ParallelState, stage_layers
from pagedllm.errors import UnsupportedModelError
from pagedllm.layers.mlp import GatedMLP
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.quantization import HALF_GGUF_TYPES, NATIVE_GGUF_TYPES, Block, common_layout
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from pagedllm.layers.vocab_parallel import VocabParallelEmbedding, vocab_shard

if TYPE_CHECKING:
    from pagedllm.models.fused_decode import FusedDecode

LlamaMLP = GatedMLP  # its name before it moved to pagedllm.layers.mlp


class LlamaAttention(nn.Module):
    """Tensor parallel as Megatron: each rank holds its q heads and their KV heads (column-parallel
    q|k|v; KV heads replicated where tp > num_kv_heads), and o_proj's matching input columns
    (row-parallel), whose partial products one all-reduce sums."""

    def __init__(
        self,
        cfg: Any,
        layer_idx: int,
        qkv_bias: bool,
        qk_norm: bool,
        sliding_window: int | None,
        ps: ParallelState | None = None,
    ):
        super().__init__()
        self.ps = ps = ps or ParallelState()
        total_heads = cfg.num_attention_heads
        total_kv = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.num_heads = total_heads // ps.tp_size
        self.num_kv_heads = max(1, total_kv // ps.tp_size)
        self.kv_head_start = ps.tp_rank * total_kv // ps.tp_size  # first KV head of this rank
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // total_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.kv_group = 0  # its block tables: meta's own, or meta.groups[kv_group - 1] (set with the cache)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=getattr(cfg, "attention_bias", False))
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.attn = get_attention_backend()

    def forward(self, x, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache, meta: AttentionMetadata):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:  # rotate q and k heads together: one set of elementwise ops
            qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim), *cos_sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            assert self.k_norm is not None  # built together with q_norm
            q = self.q_norm(qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim))
            q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        if self.kv_group:
            assert meta.groups is not None  # a layer gets a kv_group only where the cache has groups
            meta = meta.groups[self.kv_group - 1]
        o = self.attn(q, k, v, kv_cache, meta, self.scale, self.sliding_window)
        return self.ps.all_reduce(self.o_proj(o.reshape(t, self.q_size)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: Any,
        layer_idx: int,
        qkv_bias: bool,
        qk_norm: bool,
        sliding_window: int | None,
        ps: ParallelState | None = None,
        mlp: nn.Module | None = None,
    ):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, qkv_bias, qk_norm, sliding_window, ps)
        self.mlp = mlp if mlp is not None else GatedMLP(cfg, ps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos_sin, kv_cache, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


@dataclass(slots=True)
class IntermediateTensors:
    """What a pipeline stage hands the next: the hidden state and the residual stream."""

    hidden: torch.Tensor
    residual: torch.Tensor


class LlamaForCausalLM(nn.Module):
    checkpoint_sets_every_parameter = True  # load_weights raises on a missing one: no random init needed
    supports_parallel = True  # builds as cls(config, parallel=ParallelState) for tensor / pipeline parallelism
    qkv_bias_default = False
    qk_norm = False
    sliding_window_by_default = False  # Mistral applies config.sliding_window to every layer
    # EAGLE-3 reads the inputs of these layers too: forward then returns (hidden, [T, 3H] aux states)
    aux_hidden_state_layers: tuple[int, ...] = ()
    start_layer = 0  # the first layer this pipeline stage holds (its layers are named from 0 here)
    fused_decode: FusedDecode | None = None  # the worker sets one (pagedllm.models.fused_decode) unless enforce_eager

    def __init__(self, cfg: Any, parallel: ParallelState | None = None):
        super().__init__()
        self.config = cfg
        self.ps = ps = parallel or ParallelState()
        partial = getattr(cfg, "partial_rotary_factor", 1.0)
        if partial not in (None, 1.0):
            raise UnsupportedModelError(f"partial_rotary_factor={partial} is not supported")
        qkv_bias = getattr(cfg, "attention_bias", False) or getattr(cfg, "qkv_bias", self.qkv_bias_default)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.start_layer, end = stage_layers(cfg.num_hidden_layers, ps.pp_size, ps.pp_rank)
        # the first stage embeds; the last needs the embedding too when it is the (tied) head
        needs_embedding = ps.is_first_stage or (ps.is_last_stage and self.tie_word_embeddings)
        # any nn.Module: a draft head's is an nn.Embedding (or the target's), a quantized tied head's may be a
        # QuantizedEmbedding
        self.embed_tokens: nn.Module | None = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ps) if needs_embedding else None
        )
        self.layers = nn.ModuleList(self._layer(cfg, i, qkv_bias, ps) for i in range(self.start_layer, end))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if ps.is_last_stage else None
        self.rotary = RotaryEmbedding(self._attention().head_dim, rope_parameters(cfg))
        untied_head = ps.is_last_stage and not self.tie_word_embeddings
        self.lm_head = (
            nn.Linear(cfg.hidden_size, vocab_shard(cfg.vocab_size, ps)[1], bias=False) if untied_head else None
        )

    def _layer(self, cfg: Any, i: int, qkv_bias: bool, ps: ParallelState) -> nn.Module:
        return LlamaDecoderLayer(
            cfg, i, qkv_bias, self.qk_norm, self._sliding_window(cfg, i), ps, self._mlp(cfg, i, ps)
        )

    def _attention(self, i: int = 0) -> LlamaAttention:
        """Layer ``i``'s attention (this stage's numbering): every family's layers have a LlamaAttention."""
        return cast(LlamaAttention, self.layers[i].self_attn)

    def _mlp(self, cfg: Any, layer_idx: int, ps: ParallelState) -> nn.Module:
        """Layer ``layer_idx``'s feed-forward block (the MoE families return their sparse block)."""
        return GatedMLP(cfg, ps)

    def _sliding_window(self, cfg: Any, i: int) -> int | None:
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if window is None:
            return None
        if layer_types is not None:
            return window if layer_types[i] == "sliding_attention" else None
        if self.sliding_window_by_default or getattr(cfg, "use_sliding_window", False):
            return window
        return None

    # -- geometry the runner needs to size the KV cache --
    @property
    def kv_cache_shape_per_layer(self) -> tuple[int, int]:
        a = self._attention()
        return a.num_kv_heads, a.head_dim

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | IntermediateTensors:
        """The final hidden states; on a pipeline stage before the last, what the next stage takes.
        ``inputs_embeds``: the first stage's input rows, given (a multimodal prompt's) instead of embedded here."""
        if self.fused_decode is not None and intermediate is None and inputs_embeds is None and positions.dim() == 1:
            out = self.fused_decode(input_ids, positions, kv_caches, meta)
            if out is not None:
                return out
        if inputs_embeds is not None:
            x, residual = inputs_embeds, None
        elif intermediate is None:
            assert self.embed_tokens is not None  # the first stage embeds
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = intermediate.hidden, intermediate.residual
        cos_sin = self.rotary.cos_sin(positions)
        aux: dict[int, torch.Tensor] = {}
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if i in self.aux_hidden_state_layers:
                aux[i] = x if residual is None else x + residual
            x, residual = layer(x, residual, cos_sin, kv_cache, meta)
        if not self.ps.is_last_stage:
            assert residual is not None  # every stage holds a layer (check_parallel_fits)
            return IntermediateTensors(x, residual)
        assert self.norm is not None  # the last stage's
        x, _ = self.norm(x, residual)
        if self.aux_hidden_state_layers:
            return x, torch.cat([aux[i] for i in self.aux_hidden_state_layers], dim=-1)
        return x

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input rows for ``input_ids`` (what ``forward`` computes unless given
        ``inputs_embeds``)."""
        assert self.embed_tokens is not None  # the first stage embeds
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [T, vocab]; under tensor parallelism only the stage's first rank gets them
        (every rank of the last stage must call this with the same rows)."""
        if self.lm_head is None:  # tied: the embedding is the head
            assert self.embed_tokens is not None  # the last stage keeps it when tied
            local = F.linear(hidden, cast(torch.Tensor, self.embed_tokens.weight)).float()
        else:
            local = self.lm_head(hidden).float()
        return self.ps.gather_vocab(local, self.config.vocab_size) if self.ps.tp_size > 1 else local

    # -- weights --
    _FUSED: ClassVar[dict[str, tuple[str, int]]] = {  # transformers' name -> (our fused parameter, shard index)
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def _local_name(self, name: str) -> str | None:
        """A checkpoint name (``model.`` removed) as this stage names it, or None where it holds no such weight."""
        if name.startswith("layers."):
            _, idx, rest = name.split(".", 2)
            i = int(idx) - self.start_layer
            return f"layers.{i}.{rest}" if 0 <= i < len(self.layers) else None
        module = name.split(".", 1)[0]
        if module in ("embed_tokens", "norm", "lm_head"):  # absent (None) on the stages that do not need them
            return name if getattr(self, module, None) is not None else None
        return name

    def _tp_slice(self, module: str, kind: str, name: str = "") -> tuple[int, int, int] | Literal["rank0"] | None:
        """This rank's part of a checkpoint tensor as ``(dim, start, length)``; ``"rank0"`` for a
        row-parallel bias (added once, after the all-reduce); None where every rank holds all of it.
        ``name`` (this stage's name of the weight) tells a dense MLP's projections from an expert's."""
        ps = self.ps
        if ps.tp_size == 1:
            return None
        if ".experts." in name or ".shared_expert." in name:
            return None  # expert parallelism: an expert lives whole on the rank that holds it
        a = self._attention()
        parts = name.split(".")
        # read only for a dense MLP's projections (an expert's returned above)
        mlp = cast(GatedMLP, self.layers[int(parts[1]) if name.startswith("layers.") else 0].mlp)
        r = ps.tp_rank
        if module == "q_proj":
            return 0, r * a.q_size, a.q_size
        if module in ("k_proj", "v_proj"):
            return 0, a.kv_head_start * a.head_dim, a.kv_size
        if module in ("gate_proj", "up_proj"):
            return 0, r * mlp.intermediate, mlp.intermediate
        if module in ("o_proj", "down_proj"):
            if kind == "bias":
                return "rank0"
            width = a.q_size if module == "o_proj" else mlp.intermediate
            return 1, r * width, width
        if module in ("embed_tokens", "lm_head"):
            start, per_rank = vocab_shard(self.config.vocab_size, ps)
            return 0, start, min(per_rank, self.config.vocab_size - start)
        return None

    def _take(self, module: str, kind: str, tensor: Any, name: str = "") -> torch.Tensor:
        """This rank's part of ``tensor`` (a tensor, or a lazy checkpoint slice with ``narrow``)."""
        part = self._tp_slice(module, kind, name)
        if part == "rank0":
            full = _materialize(tensor)
            return full if self.ps.tp_rank == 0 else torch.zeros_like(full)
        if part is None:
            return _materialize(tensor)
        return tensor.narrow(*part)

    def _stage_name(self, name: str) -> str | None:
        """A checkpoint weight's name as this stage holds it (before fusing), None where it holds no such weight."""
        name = self._checkpoint_name(name.removeprefix("model."))
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and getattr(self, "lm_head", None) is None:
            return None  # tied (the embedding is the head), or not this pipeline stage's
        return self._local_name(name)

    def weight_target(self, name: str) -> str | None:
        """The parameter checkpoint weight ``name`` loads into (a fused projection's, for its shards), None
        where this stage holds no such weight."""
        local = self._stage_name(name)
        if local is None:
            return None
        parts = local.split(".")
        if len(parts) >= 2 and parts[-2] in self._FUSED:
            return ".".join(parts[:-2] + [self._FUSED[parts[-2]][0], parts[-1]])
        return local

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load ``(hf name, tensor)`` pairs: under tensor parallelism a lazy slice (``narrow``) reads only
        this rank's part; a pipeline stage skips the layers it does not hold."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = self._stage_name(hf_name)
            if name is None:
                continue
            parts = name.split(".")
            module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
            if module in self._FUSED:
                fused, shard = self._FUSED[module]
                target = ".".join(parts[:-2] + [fused, kind])
                param: torch.Tensor = params[target]
                offset, size = self._shard_range(fused, shard, param)
                param.data[offset : offset + size].copy_(self._take(module, kind, tensor, name))
                loaded.add(f"{target}#{shard}")
                continue
            if name not in params:
                raise UnsupportedModelError(f"checkpoint has unexpected weight {name!r} for {type(self).__name__}")
            tensor = self._take(module, kind, tensor, name)
            param = params[name]
            if module in ("embed_tokens", "lm_head") and self.ps.tp_size > 1:  # the last shard may be padded
                param.data.zero_()
                param = param.data[: tensor.shape[0]]
            if param.shape != tensor.shape:
                raise UnsupportedModelError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
            loaded.add(name)
        missing = [n for n in self._expected_loads(params) if n not in loaded]
        if missing:
            raise UnsupportedModelError(
                f"checkpoint is missing weights: {missing[:8]}{' …' if len(missing) > 8 else ''}"
            )
        return loaded

    def quantized_modules(self, blocks: Mapping[str, Block] | Iterable[tuple[str, Block]]) -> dict[str, Block]:
        """Map a checkpoint's quantized blocks, keyed by transformers' weight names as ``(kind, row-aligned
        tensors)``, to our module names: fused projections concatenate their shards' rows (in one layout:
        :func:`~pagedllm.layers.quantization.common_layout`; kept only when every shard is there); a tied
        embedding also serves as ``lm_head``. Under tensor parallelism each block is cut to this rank's part
        first (columns in whole groups of 32). ``blocks`` may be an iterator: a fused module's shards are let go
        as soon as it is complete, so at most one layer's shards are held beside the result."""
        shards: dict[str, dict[int, tuple[str, tuple[torch.Tensor, ...] | None]]] = {}
        out: dict[str, Block] = {}

        def add(module: str, shard: int, block: tuple[str, tuple[torch.Tensor, ...] | None]) -> None:
            got = shards.setdefault(module, {})
            got[shard] = block
            n = 3 if module.endswith("qkv_proj") else 2 if module.endswith("gate_up_proj") else 1
            if len(got) < n:  # shards 0..n-1, each present
                return
            del shards[module]
            if any(got[i][1] is None for i in range(n)):
                return
            # one layout: int4 shards beside an int8 one widen, a scale per 32 beside one per 16 doubles
            whole = [cast(Block, got[i]) for i in range(n)]
            halves = {kind for kind, _ in whole if kind in HALF_GGUF_TYPES}
            if halves == {"BF16", "BF16P"}:  # a shard not in whole panels beside repacked ones: all as stored
                from pagedllm.kernels.ops import GGUFBlocks

                whole = [("BF16", (GGUFBlocks.unpack_bf16(t[0]),)) if k == "BF16P" else (k, t) for k, t in whole]
                halves = {"BF16"}
            if halves:  # float16 / bfloat16 shards as stored: one weight, where every shard is of one such type
                if len(halves) == 1 and all(kind in halves for kind, _ in whole):
                    tensors = whole[0][1] if n == 1 else (torch.cat([t[0] for _, t in whole]),)
                    if n > 1:  # the copy holds them: the file's pages, read again by the copy, can go
                        from pagedllm.model_loader.mappings import release_mapped_pages

                        for _, t in whole:
                            release_mapped_pages(t[0])
                    out[module] = (whole[0][0], tensors)
                return  # else (beside quantized shards) the module stays float, every shard widened
            if any(kind in NATIVE_GGUF_TYPES for kind, _ in whole) and not all(
                kind in NATIVE_GGUF_TYPES for kind, _ in whole
            ):  # the file's blocks beside shards in our layouts: converted too
                from pagedllm.model_loader.gguf_loader import converted_block

                whole = [converted_block(k, t[0]) if k in NATIVE_GGUF_TYPES else (k, t) for k, t in whole]
            parts = common_layout(whole)
            if all(kind in NATIVE_GGUF_TYPES for kind, _ in parts):  # as the file stores them, one kernel a shard
                out[module] = ("gguf:" + ",".join(kind for kind, _ in parts), tuple(t[0] for _, t in parts))
            elif len({(kind, t[1].shape[1:], len(t)) for kind, t in parts}) == 1:
                tensors = (
                    parts[0][1]
                    if n == 1
                    else tuple(torch.cat([t[j] for _, t in parts]) for j in range(len(parts[0][1])))
                )
                out[module] = (parts[0][0], tensors)

        for name, (kind, tensors) in blocks.items() if isinstance(blocks, Mapping) else blocks:
            hf_module = name.removeprefix("model.").removesuffix(".weight")
            local = self._local_name(hf_module + ".weight")
            leaf = hf_module.split(".")[-1]
            if hf_module == "embed_tokens":
                if self.lm_head is None and self.ps.is_last_stage:
                    add("lm_head", 0, (kind, _slice_block(tensors, self._tp_slice(leaf, "weight"), kind)))
                if self.embed_tokens is not None and self.ps.tp_size == 1:  # its own rows, where they are whole
                    add("embed_tokens", 0, (kind, tensors))
                continue
            if local is None:
                continue
            path = local.removesuffix(".weight").split(".")
            fused, shard = self._FUSED.get(path[-1], (path[-1], 0))
            add(
                ".".join(path[:-1] + [fused]),
                shard,
                (kind, _slice_block(tensors, self._tp_slice(leaf, "weight", local), kind)),
            )
        return out

    def _checkpoint_name(self, name: str) -> str:
        """A checkpoint's weight name in this family's terms (Mixtral renames its experts' weights)."""
        return name

    def _shard_range(self, fused: str, shard: int, param: torch.Tensor) -> tuple[int, int]:
        if fused == "qkv_proj":
            a = self._attention()
            sizes = [a.q_size, a.kv_size, a.kv_size]
        else:  # gate | up, of whichever MLP (dense, expert or shared expert) this is
            sizes = [param.shape[0] // 2] * 2
        return sum(sizes[:shard]), sizes[shard]

    def _expected_loads(self, params: dict[str, nn.Parameter]) -> list[str]:
        out = []
        for name in params:
            fused = name.split(".")[-2] if "." in name else ""
            if fused == "qkv_proj":
                out += [f"{name}#{i}" for i in range(3)]
            elif fused == "gate_up_proj":
                out += [f"{name}#{i}" for i in range(2)]
            else:
                out.append(name)
        return out


def _materialize(tensor: Any) -> torch.Tensor:
    return tensor if isinstance(tensor, torch.Tensor) else tensor.narrow(0, 0, tensor.shape[0])


def _slice_block(
    tensors: tuple[torch.Tensor, ...], part: tuple[int, int, int] | Literal["rank0"] | None, kind: str
) -> tuple[torch.Tensor, ...] | None:
    """A quantized block's rows / groups for this rank: rows are whole; columns (row-parallel) are cut in
    groups of 32 (q's bytes, the scales and the mins (a 32 or a 16 each) alike). None where the cut splits a
    group. ``kind``: the block's layout ("int4" / "int8": q holds half a byte / a byte a weight)."""
    if part is None:
        return tensors
    if part == "rank0":
        return None
    dim, start, length = part
    if len(tensors) == 4:  # act-order: its input order spans every rank's columns
        return None
    if dim == 0:
        return tuple(t.narrow(0, start, length) for t in tensors)
    if tensors[1].dim() == 1:  # FP8: a scale per row, whatever the columns
        return tensors[0].narrow(1, start, length), tensors[1]
    if start % 32 or length % 32:
        return None
    # the weights a row: q's bytes (one or half a one a weight), else the mins (one per 32)
    k = tensors[0].shape[1] * (2 if kind == "int4" else 1) if kind in ("int4", "int8") else tensors[-1].shape[1] * 32
    return tuple(t.narrow(1, start * t.shape[1] // k, length * t.shape[1] // k) for t in tensors)


class MistralForCausalLM(LlamaForCausalLM):
    sliding_window_by_default = True


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class _MoEWeights(LlamaForCausalLM):
    """Under expert parallelism a rank loads only its own experts (renumbered from 0), and only rank 0
    the shared expert."""

    def _local_name(self, name: str) -> str | None:
        local = super()._local_name(name)
        if local is None or ".mlp." not in local or self.ps.tp_size == 1:
            return local
        parts = local.split(".")
        if "shared_expert" in parts or "shared_expert_gate" in parts:
            return local if self.ps.tp_rank == 0 else None
        if "experts" in parts:
            from pagedllm.layers.fused_moe import local_experts

            i = parts.index("experts") + 1
            first, count = local_experts(
                getattr(self.config, "num_local_experts", None) or self.config.num_experts, self.ps
            )
            e = int(parts[i]) - first
            if not 0 <= e < count:
                return None
            parts[i] = str(e)
        return ".".join(parts)


class MixtralForCausalLM(_MoEWeights):
    """Every layer a sparse block of ``num_local_experts`` experts, top-``num_experts_per_tok`` routing
    renormalised over the chosen experts."""

    sliding_window_by_default = True

    def _mlp(self, cfg: Any, layer_idx: int, ps: ParallelState) -> nn.Module:
        from pagedllm.layers.fused_moe import FusedMoE

        return FusedMoE(
            cfg, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, renormalize=True, ps=ps
        )

    _MIXTRAL_NAMES: ClassVar[dict[str, str]] = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

    def _checkpoint_name(self, name: str) -> str:
        parts = name.replace(".block_sparse_moe.", ".mlp.").split(".")
        if len(parts) >= 2 and parts[-2] in self._MIXTRAL_NAMES and "experts" in parts:
            parts[-2] = self._MIXTRAL_NAMES[parts[-2]]
        return ".".join(parts)


class Qwen2MoeForCausalLM(_MoEWeights):
    """Sparse layers (every ``decoder_sparse_step``-th, except ``mlp_only_layers``) route to
    ``num_experts`` experts and add a shared expert gated by a sigmoid; QKV biases as Qwen2."""

    qkv_bias_default = True
    shared_expert = True

    def _mlp(self, cfg: Any, layer_idx: int, ps: ParallelState) -> nn.Module:
        from pagedllm.layers.fused_moe import FusedMoE

        sparse = (
            layer_idx not in (getattr(cfg, "mlp_only_layers", None) or [])
            and cfg.num_experts > 0
            and (layer_idx + 1) % getattr(cfg, "decoder_sparse_step", 1) == 0
        )
        if not sparse:
            return GatedMLP(cfg, ps)
        shared = getattr(cfg, "shared_expert_intermediate_size", 0) if self.shared_expert else 0
        return FusedMoE(
            cfg,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
            shared_intermediate=shared,
            ps=ps,
        )


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen2-MoE's layout without the shared expert, with Qwen3's q/k norms and no QKV bias."""

    qkv_bias_default = False
    qk_norm = True
    shared_expert = False
