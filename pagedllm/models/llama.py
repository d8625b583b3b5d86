"""The Llama family, config-driven: Llama 2/3, Mistral, Qwen2 (QKV bias), Qwen3 (q/k norm), SmolLM2.

Projections are fused (q|k|v and gate|up) so each layer runs two big matmuls
instead of five; :meth:`LlamaForCausalLM.load_weights` maps transformers'
separate tensors into the fused ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import kernels
from pagedllm.attention import AttentionMetadata, get_attention_backend
from pagedllm.errors import UnsupportedModelError
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, qkv_bias: bool, qk_norm: bool, sliding_window: int | None):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=getattr(cfg, "attention_bias", False))
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.attn = get_attention_backend()

    def forward(self, x, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache, meta: AttentionMetadata):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:  # rotate q and k heads together: one set of elementwise ops
            qk = apply_rotary(qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim), *cos_sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = self.q_norm(qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim))
            q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        o = self.attn(q, k, v, kv_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; only 'silu'")
        bias = getattr(cfg, "mlp_bias", False)
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        k = kernels.for_tensor(gate_up)
        if k is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
            return self.down_proj(k.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, qkv_bias: bool, qk_norm: bool, sliding_window: int | None):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, qkv_bias, qk_norm, sliding_window)
        self.mlp = LlamaMLP(cfg)
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


class LlamaForCausalLM(nn.Module):
    checkpoint_sets_every_parameter = True  # load_weights raises on a missing one: no random init needed
    qkv_bias_default = False
    qk_norm = False
    sliding_window_by_default = False  # Mistral applies config.sliding_window to every layer
    # EAGLE-3 reads the inputs of these layers too: forward then returns (hidden, [T, 3H] aux states)
    aux_hidden_state_layers: tuple[int, ...] = ()

    def __init__(self, cfg: Any):
        super().__init__()
        self.config = cfg
        partial = getattr(cfg, "partial_rotary_factor", 1.0)
        if partial not in (None, 1.0):
            raise UnsupportedModelError(f"partial_rotary_factor={partial} is not supported")
        qkv_bias = getattr(cfg, "attention_bias", False) or self.qkv_bias_default
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, qkv_bias, self.qk_norm, self._sliding_window(cfg, i))
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        head_dim = self.layers[0].self_attn.head_dim
        self.rotary = RotaryEmbedding(head_dim, cfg.max_position_embeddings, rope_parameters(cfg))
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

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
        a = self.layers[0].self_attn
        return a.num_kv_heads, a.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x = self.embed_tokens(input_ids)
        residual = None
        cos_sin = self.rotary.cos_sin(positions)
        aux: dict[int, torch.Tensor] = {}
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if i in self.aux_hidden_state_layers:
                aux[i] = x if residual is None else x + residual
            x, residual = layer(x, residual, cos_sin, kv_cache, meta)
        x, _ = self.norm(x, residual)
        if self.aux_hidden_state_layers:
            return x, torch.cat([aux[i] for i in self.aux_hidden_state_layers], dim=-1)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied: the embedding is the head
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    # -- weights --
    _FUSED = {  # transformers' name -> (our fused parameter, shard index)
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in self._FUSED:
                fused, shard = self._FUSED[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
                param = params[target]
                offset, size = self._shard_range(fused, shard)
                param.data[offset:offset + size].copy_(tensor)
                loaded.add(f"{target}#{shard}")
                continue
            if name not in params:
                raise UnsupportedModelError(f"checkpoint has unexpected weight {name!r} for {type(self).__name__}")
            if params[name].shape != tensor.shape:
                raise UnsupportedModelError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
            params[name].data.copy_(tensor)
            loaded.add(name)
        missing = [n for n in self._expected_loads(params) if n not in loaded]
        if missing:
            raise UnsupportedModelError(f"checkpoint is missing weights: {missing[:8]}{' …' if len(missing) > 8 else ''}")
        return loaded

    def quantized_modules(self, blocks: dict[str, tuple[str, tuple[torch.Tensor, ...]]]
                          ) -> dict[str, tuple[str, tuple[torch.Tensor, ...]]]:
        """Map a checkpoint's quantized blocks, keyed by transformers' weight names as ``(kind, row-aligned
        tensors)``, to our module names: fused projections concatenate their shards' rows (kept only when
        every shard is there, of one kind); a tied embedding also serves as ``lm_head``."""
        shards: dict[str, dict[int, tuple[str, tuple[torch.Tensor, ...]]]] = {}
        for name, block in blocks.items():
            module = name.removeprefix("model.").removesuffix(".weight").split(".")
            if module == ["embed_tokens"]:
                if self.lm_head is None:
                    shards["lm_head"] = {0: block}
                continue
            fused, shard = self._FUSED.get(module[-1], (module[-1], 0))
            shards.setdefault(".".join(module[:-1] + [fused]), {})[shard] = block
        out = {}
        for module, got in shards.items():
            n = 3 if module.endswith("qkv_proj") else 2 if module.endswith("gate_up_proj") else 1
            kinds = {kind for kind, _ in got.values()}
            if len(got) == n and len(kinds) == 1:
                parts = [got[i][1] for i in range(n)]
                out[module] = (kinds.pop(), tuple(torch.cat([p[j] for p in parts]) for j in range(len(parts[0]))))
        return out

    def _shard_range(self, fused: str, shard: int) -> tuple[int, int]:
        if fused == "qkv_proj":
            a = self.layers[0].self_attn
            sizes = [a.q_size, a.kv_size, a.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
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


class MistralForCausalLM(LlamaForCausalLM):
    sliding_window_by_default = True


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
