"""Gemma 3 (text): the Llama layout with Gemma's differences, each where transformers' Gemma3 puts it.

* Interleaved attention: ``layer_types`` (or every ``sliding_window_pattern``-th layer global) marks each
  layer sliding-window (local) or global; local layers rotate with their own RoPE base
  (``rope_local_base_freq``, or ``rope_parameters["sliding_attention"]``).
* Sandwich norms: the attention and MLP outputs are normalised again before each joins the residual
  stream (``post_attention_layernorm``, ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``).
* Gemma's RMSNorm multiplies by ``1 + weight``: checkpoints store ``weight``, and loading adds the one, so
  the shared :class:`RMSNorm` (and its fused kernel) runs unchanged. GGUF files store ``1 + weight``
  already; the GGUF loader gives it back in the checkpoints' convention, as transformers does.
* q/k RMSNorm before RoPE, attention scaled by ``query_pre_attn_scalar ** -0.5``, a GeGLU MLP
  (tanh-approximated GELU), embeddings scaled by ``sqrt(hidden_size)``, the head tied to the embedding,
  and ``final_logit_softcapping`` where the config sets it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention import AttentionMetadata
from pagedllm.distributed import ParallelState
from pagedllm.errors import UnsupportedModelError
from pagedllm.layers.mlp import GatedMLP
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.models.llama import IntermediateTensors, LlamaAttention, LlamaForCausalLM, _materialize


class Gemma3MLP(GatedMLP):
    """gate|up column-parallel, down row-parallel, as Llama's; ``gelu(gate, tanh) * up``."""

    activations = ("gelu_pytorch_tanh", "gelu_tanh")

    def _local(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, sliding_window: int | None, ps: ParallelState):
        super().__init__()
        self.is_sliding = sliding_window is not None
        self.self_attn = LlamaAttention(cfg, layer_idx, False, True, sliding_window, ps)
        self.self_attn.scale = float(cfg.query_pre_attn_scalar) ** -0.5
        self.mlp = Gemma3MLP(cfg, ps)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward(self, x, residual, cos_sin, kv_cache, meta):
        """``x + residual`` is the hidden stream (``residual`` None before the first layer)."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, cos_sin, kv_cache, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

    def __init__(self, cfg: Any, parallel: ParallelState | None = None):
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            raise UnsupportedModelError(f"attn_logit_softcapping={cfg.attn_logit_softcapping} is not supported")
        super().__init__(cfg, parallel)
        self.rotary_local = RotaryEmbedding(self._attention().head_dim, self._local_rope_parameters(cfg))
        # float32, as transformers keeps it, whatever the weights' dtype
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5)
        self.final_logit_softcapping = getattr(cfg, "final_logit_softcapping", None)

    def _layer(self, cfg: Any, i: int, qkv_bias: bool, ps: ParallelState) -> nn.Module:
        return Gemma3DecoderLayer(cfg, i, self._sliding_window(cfg, i), ps)

    def _sliding_window(self, cfg: Any, i: int) -> int | None:
        if getattr(cfg, "layer_types", None) is None:  # older configs: every pattern-th layer is global
            pattern = cast(
                int, getattr(cfg, "sliding_window_pattern", None) or getattr(cfg, "_sliding_window_pattern", 6)
            )
            return cfg.sliding_window if (i + 1) % pattern else None
        return super()._sliding_window(cfg, i)

    def _local_rope_parameters(self, cfg: Any) -> dict[str, Any]:
        per_type = getattr(cfg, "rope_parameters", None)
        if isinstance(per_type, dict) and "sliding_attention" in per_type:  # transformers v5
            return rope_parameters(cfg, "sliding_attention")
        return {"rope_type": "default", "rope_theta": getattr(cfg, "rope_local_base_freq", 10000.0)}

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if inputs_embeds is not None:  # scaled already (embed_input_ids)
            x, residual = inputs_embeds, None
        elif intermediate is None:
            assert self.embed_tokens is not None  # the first stage embeds
            x, residual = self.embed_input_ids(input_ids), None
        else:
            x, residual = intermediate.hidden, intermediate.residual
        global_cs, local_cs = self.rotary.cos_sin(positions), self.rotary_local.cos_sin(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, local_cs if layer.is_sliding else global_cs, kv_cache, meta)
        if not self.ps.is_last_stage:
            assert residual is not None  # every stage holds a layer (check_parallel_fits)
            return IntermediateTensors(x, residual)
        assert self.norm is not None  # the last stage's
        x, _ = self.norm(x, residual)
        return x

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input rows: Gemma scales its embeddings by sqrt(hidden_size)."""
        assert self.embed_tokens is not None  # the first stage embeds
        x = self.embed_tokens(input_ids)
        return x * self.embed_scale.to(x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        if logits is not None and cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Gemma's norms scale by ``1 + weight``: the one is added here, once."""

        def plus_one(pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
            for name, tensor in pairs:
                if name.endswith("norm.weight"):
                    tensor = _materialize(tensor).float() + 1.0
                yield name, tensor

        return super().load_weights(plus_one(weights))
