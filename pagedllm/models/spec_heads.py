"""Draft heads that read the target's hidden states: EAGLE, EAGLE-3 and MEDUSA, in their published layouts.

* **EAGLE** (SafeAILab/EAGLE, the HF directories vLLM loads as ``method: eagle``): a Llama config
  with (usually) one decoder layer. ``fc`` [H, 2H] (bias optional) fuses the embedding of token
  p+1 with the target's final hidden state at p; layer 0 has no input norm; there is no final
  norm, and the target's ``lm_head`` turns the output into logits. ``embed_tokens`` is optional
  (the target's is used when it is absent).
* **EAGLE-3** (``method: eagle3``; ``midlayer.*`` weights): ``fc`` [H, 3·H_target] fuses three of
  the target's intermediate hidden states (the inputs of layers ``eagle_aux_hidden_state_layer_ids``,
  by default 2, L/2 and L-3); layer 0's attention reads [input_norm(embedding), hidden_norm(hidden)]
  (2H wide); a final ``norm``; its own ``lm_head`` over ``draft_vocab_size`` tokens, mapped to the
  target's ids by ``d2t`` (target id = draft id + d2t[draft id]).
* **MEDUSA** (vLLM's ``MedusaModel`` layout: ``blocks.{i}.layers.{j}``, ``lm_heads.{i}``; or the
  original FasterDecoding names ``{i}.{j}.linear`` / ``{i}.{L}``): head i is a stack of residual
  SiLU blocks and a vocabulary projection; applied to the target's final hidden state at p it
  guesses token p+2+i. An optional ``token_map`` restricts it to a truncated vocabulary.

Hidden sizes are checked against the target before any weight is read.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import ParallelState
from pagedllm.errors import InvalidParameterError, UnsupportedModelError
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM

if TYPE_CHECKING:
    import transformers


def _bad(msg: str) -> InvalidParameterError:
    return InvalidParameterError(f"speculative_config.model: {msg}", "speculative_config.model")


class EagleHead(LlamaForCausalLM):
    """EAGLE (``eagle3=False``) or EAGLE-3 draft head. ``forward`` returns ``(for_logits, next_hidden)``."""

    _OPTIONAL = ("embed_tokens.weight", "fc.bias", "lm_head.weight")  # taken from the target, or zero
    d2t: torch.Tensor  # EAGLE-3's buffer (register_buffer), typed for mypy

    def __init__(self, cfg: Any, eagle3: bool):
        nn.Module.__init__(self)
        self.config = cfg
        self.ps = ParallelState()  # heads run in one process
        self.eagle3 = eagle3
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        qkv_bias = bool(getattr(cfg, "attention_bias", False))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, qkv_bias, False, None) for i in range(cfg.num_hidden_layers)
        )
        first = self.layers[0]
        if eagle3:
            a = self._attention()
            a.qkv_proj = nn.Linear(2 * h, a.q_size + 2 * a.kv_size, bias=qkv_bias)
            first.hidden_norm = RMSNorm(h, eps)
            self.fc = nn.Linear(3 * (getattr(cfg, "target_hidden_size", None) or h), h, bias=True)
            self.norm = RMSNorm(h, eps)
            self.lm_head = nn.Linear(h, getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(self.lm_head.out_features, dtype=torch.long))
            self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))
        else:
            first.input_layernorm = nn.Identity()
            self.fc = nn.Linear(2 * h, h, bias=True)
        self.fc.bias.data.zero_()  # published heads may lack it: then it is zero
        self.rotary = RotaryEmbedding(self._attention().head_dim, rope_parameters(cfg))

    # Llama's layers and weight loading, with a forward of its own: a head also takes the target's hidden states
    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token p+1's embedding with the features at p (the target's, or this head's own ``next_hidden``)."""
        assert self.embed_tokens is not None  # its own, or the target's
        emb = self.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions)
        first = cast(LlamaDecoderLayer, self.layers[0])
        if self.eagle3:
            residual = cast(RMSNorm, first.hidden_norm)(hidden)  # EAGLE-3's, added in __init__
            x = torch.cat([first.input_layernorm(emb), residual], dim=-1)
            if not self.norm_before_residual:
                residual = hidden
            x = first.self_attn(x, cos_sin, kv_caches[0], meta)
            x, residual = first.post_attention_layernorm(x, residual)
            x = first.mlp(x)
        else:
            x, residual = first(self.fc(torch.cat([emb, hidden], dim=-1)), None, cos_sin, kv_caches[0], meta)
        for layer, kv_cache in zip(self.layers[1:], kv_caches[1:]):
            x, residual = layer(x, residual, cos_sin, kv_cache, meta)
        if self.eagle3:
            assert self.norm is not None  # EAGLE-3's final norm
            return self.norm(x, residual)
        x = x + residual
        return x, x

    def target_features(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """The first draft step's features: the target's final hidden state, or (EAGLE-3) its fused aux states."""
        return self.fc(aux) if self.eagle3 else hidden

    def draft_token_ids(self, h: torch.Tensor, target_logits: Any) -> torch.Tensor:
        if not self.eagle3 or self.lm_head is None:
            return target_logits(h).argmax(dim=-1)
        ids = self.lm_head(h).argmax(dim=-1)
        return ids + self.d2t[ids]

    # a method here, an attribute on the target: the worker sets the target's attribute from this
    def aux_hidden_state_layers(self, num_target_layers: int) -> tuple[int, ...]:  # type: ignore[override]
        ids = (
            getattr(self.config, "eagle_aux_hidden_state_layer_ids", None)
            or (getattr(self.config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
            or (2, num_target_layers // 2, num_target_layers - 3)
        )
        ids = tuple(int(i) for i in ids)
        if len(ids) != 3 or not all(0 <= i < num_target_layers for i in ids):
            raise _bad(
                f"EAGLE-3 reads the target's hidden states at layers {list(ids)}, but the target has "
                f"{num_target_layers} layers; set eagle_aux_hidden_state_layer_ids in the head's config"
            )
        return ids

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
                if name == "t2d":
                    continue
                if name == "d2t":
                    if not self.eagle3:
                        raise UnsupportedModelError("an EAGLE (v1) head has no d2t; is this an EAGLE-3 head?")
                    self.d2t.copy_(tensor.to(torch.long))
                    self._has_d2t = True
                    continue
                if name == "lm_head.weight" and not self.eagle3:
                    continue  # EAGLE's logits come from the target's head
                yield name, tensor

        self._has_d2t = False
        loaded = super().load_weights(renamed())
        if self._has_d2t:
            loaded.add("d2t")
        return loaded

    def _expected_loads(self, params: dict[str, nn.Parameter]) -> list[str]:
        return [n for n in super()._expected_loads(params) if n not in self._OPTIONAL]


class _ResidualBlock(nn.Module):
    def __init__(self, hidden: int, num_layers: int):
        super().__init__()
        linears = [nn.Linear(hidden, hidden, bias=True) for _ in range(num_layers)]
        for linear in linears:  # published heads may lack the biases (medusa_fc_bias false): then zero
            linear.bias.data.zero_()
        self.layers = nn.ModuleList(linears)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHead(nn.Module):
    _ORIGINAL = re.compile(r"^(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")  # FasterDecoding's names
    token_map: torch.Tensor  # a buffer (register_buffer), typed for mypy

    def __init__(self, cfg: Any):
        super().__init__()
        self.config = cfg
        self.num_heads, self.num_layers = cfg.num_heads, cfg.num_hidden_layers
        vocab = cfg.truncated_vocab_size or cfg.vocab_size
        self.blocks = nn.ModuleList(
            _ResidualBlock(cfg.hidden_size, cfg.num_hidden_layers) for _ in range(cfg.num_heads)
        )
        self.lm_heads = nn.ModuleList(
            nn.Linear(cfg.hidden_size, vocab, bias=False) for _ in range(1 if cfg.original_lm_head else cfg.num_heads)
        )
        self.register_buffer("token_map", torch.arange(vocab))

    def draft_token_ids(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """[T, k]: head i's greedy guess for the token 2+i after each row's position."""
        cols = [self.lm_heads[min(i, len(self.lm_heads) - 1)](self.blocks[i](hidden)).argmax(dim=-1) for i in range(k)]
        return self.token_map[torch.stack(cols, dim=1)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("medusa_heads.")
            m = self._ORIGINAL.match(name)
            if m:
                i, j, kind = int(m[1]), int(m[2]), m[3]
                name = f"lm_heads.{i}.weight" if j == self.num_layers else f"blocks.{i}.layers.{j}.{kind}"
            if name == "lm_head.weight":
                name = "lm_heads.0.weight"
            if name == "token_map":
                if len(tensor) != len(self.token_map):
                    raise UnsupportedModelError(
                        f"token_map has {len(tensor)} entries, the heads {len(self.token_map)} (truncated_vocab_size)"
                    )
                self.token_map.copy_(tensor.to(torch.long))
                loaded.add(name)
                continue
            if name not in params:
                raise UnsupportedModelError(f"MEDUSA checkpoint has unexpected weight {name!r}")
            if params[name].shape != tensor.shape:
                raise UnsupportedModelError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
                )
            params[name].data.copy_(tensor)
            loaded.add(name)
        missing = [n for n in params if n not in loaded and not n.endswith(".bias")]
        if missing:
            raise UnsupportedModelError(f"MEDUSA checkpoint is missing weights: {missing[:8]}")
        if self.config.truncated_vocab_size and "token_map" not in loaded:
            raise UnsupportedModelError("truncated_vocab_size is set but the checkpoint has no token_map")
        return loaded


# -- loading -------------------------------------------------------------------------


def _medusa_config(raw: dict[str, Any], target_cfg: Any) -> SimpleNamespace:
    """vLLM's MedusaConfig fields, or the original checkpoint's ``medusa_num_heads`` / ``medusa_num_layers``
    (which leave the sizes to the base model)."""
    num_heads = raw.get("num_heads", raw.get("medusa_num_heads"))
    num_layers = raw.get("num_hidden_layers", raw.get("medusa_num_layers", 1))
    if not isinstance(num_heads, int) or num_heads < 1:
        raise _bad("a MEDUSA config.json needs num_heads (or medusa_num_heads) >= 1")
    return SimpleNamespace(
        num_heads=num_heads,
        num_hidden_layers=int(num_layers),
        hidden_size=raw.get("hidden_size", target_cfg.hidden_size),
        vocab_size=raw.get("vocab_size", target_cfg.vocab_size),
        truncated_vocab_size=raw.get("truncated_vocab_size"),
        original_lm_head=bool(raw.get("original_lm_head", False)),
    )


def _iter_head_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """safetensors, or the PyTorch files most published heads ship (read with ``weights_only``: tensors only)."""
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if files:
        from pagedllm.model_loader.hf_loader import iter_hf_weights

        yield from iter_hf_weights(path)
        return
    files = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth")))
    if not files:
        raise _bad(f"{path!r} has no weights (*.safetensors, *.bin or *.pt)")
    for f in files:
        state = torch.load(os.path.join(path, f), map_location="cpu", weights_only=True)
        for name, tensor in state.items():
            yield name, tensor if tensor.dtype in (torch.int64, torch.int32, torch.bool) else tensor.float()


def load_spec_head(
    method: str, model: str | None, target: nn.Module, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """Build, check against ``target`` and load the head of ``method`` ('eagle', 'eagle3', 'medusa')."""
    from pagedllm.model_loader.resolve import resolve_local
    from pagedllm.worker.loader import _no_init

    if not model:
        raise InvalidParameterError(
            f"speculative_config.model: method {method!r} needs the head's directory", "speculative_config.model"
        )
    source = resolve_local(model, what="speculative_config.model")
    if source.kind != "hf_dir":
        raise _bad(f"a {method} head is a directory with config.json, not {source.path!r}")
    tcfg: Any = target.config  # a transformers config (nn.Module's __getattr__ types it as a submodule)
    cfg: SimpleNamespace | transformers.PretrainedConfig
    with open(os.path.join(source.path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    if method == "medusa":
        cfg = _medusa_config(raw, tcfg)
        features = cfg.hidden_size
    else:
        from pagedllm.model_loader.hf_loader import load_hf_config

        cfg = load_hf_config(source.path)
        features = (
            (getattr(cfg, "target_hidden_size", None) or cfg.hidden_size) if method == "eagle3" else cfg.hidden_size
        )
    if features != tcfg.hidden_size:
        raise _bad(
            f"the {method} head reads hidden states of size {features}, but the target's hidden size "
            f"is {tcfg.hidden_size}; a head must be trained for this target"
        )
    if cfg.vocab_size != tcfg.vocab_size:
        raise _bad(
            f"the {method} head's vocabulary ({cfg.vocab_size} tokens) differs from the target's ({tcfg.vocab_size})"
        )
    with torch.device(device), _no_init():
        if method == "medusa":
            head: MedusaHead | EagleHead = MedusaHead(cfg)
        else:
            head = EagleHead(cfg, method == "eagle3")
    loaded = head.load_weights(_iter_head_weights(source.path))
    if isinstance(head, EagleHead):
        if "embed_tokens.weight" not in loaded:
            if cfg.hidden_size != tcfg.hidden_size:
                raise _bad(
                    f"the head has no embed_tokens and its hidden size ({cfg.hidden_size}) differs from "
                    f"the target's ({tcfg.hidden_size}), so it cannot share the target's"
                )
            head.embed_tokens = cast(nn.Module, target.embed_tokens)
        if head.eagle3 and "lm_head.weight" not in loaded:
            assert head.lm_head is not None  # EAGLE-3 builds its own
            if head.lm_head.out_features != tcfg.vocab_size:
                raise _bad("an EAGLE-3 head with a draft vocabulary needs its own lm_head")
            head.lm_head = None  # the target's head gives the logits
        if (
            head.eagle3
            and head.lm_head is not None
            and head.lm_head.out_features != tcfg.vocab_size
            and "d2t" not in loaded
        ):
            raise _bad("an EAGLE-3 head with draft_vocab_size < vocab_size needs d2t")
    head.to(dtype=dtype)
    head.eval()
    if device.type == "cpu" and dtype == torch.float32:
        from pagedllm.layers.linear import onednn_available, pack_linears

        if onednn_available():
            pack_linears(head)
    return head
