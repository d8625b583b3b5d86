"""BERT encoders (``BertModel``: all-MiniLM-L6-v2 and the sentence-transformers family) for pooling.

The batch is flattened as the generating models' is: ``input_ids`` and ``positions`` of every
sequence back to back, ``seq_lens`` saying where each ends. The linears and norms run on all
tokens at once; only attention (bidirectional, within each sequence) gathers the sequences
into a padded [batch, heads, longest, head_dim] block for one SDPA call with a key-padding mask.
Nothing is cached: a pooling request is one forward pass.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.errors import UnsupportedModelError


class BertLayer(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = h // self.num_heads
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.intermediate = nn.Linear(h, cfg.intermediate_size)
        self.output = nn.Linear(cfg.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)

    def forward(
        self, x: torch.Tensor, pad_index: torch.Tensor, key_mask: torch.Tensor, shape: tuple[int, int]
    ) -> torch.Tensor:
        b, longest = shape
        t, hsize = x.shape
        qkv = self.qkv(x).view(t, 3, self.num_heads, self.head_dim)
        padded = qkv.new_zeros(b * longest, 3, self.num_heads, self.head_dim)
        padded[pad_index] = qkv
        q, k, v = padded.view(b, longest, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)  # [b, heads, longest, head_dim]
        o = o.transpose(1, 2).reshape(b * longest, hsize)[pad_index]
        x = self.attn_norm(self.attn_out(o) + x)
        return self.out_norm(self.output(F.gelu(self.intermediate(x))) + x)


class BertModel(nn.Module):
    checkpoint_sets_every_parameter = True
    is_pooling_model = True

    def __init__(self, cfg: Any):
        super().__init__()
        if getattr(cfg, "hidden_act", "gelu") != "gelu":
            raise UnsupportedModelError(f"hidden_act {cfg.hidden_act!r} is not supported for BERT; only 'gelu'")
        if getattr(cfg, "position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError("only absolute position embeddings are supported for BERT")
        self.config = cfg
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """Hidden states [T, H] of the flattened batch (every token type 0, as for single sentences)."""
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        x = self.embed_norm(x)
        b, longest = len(seq_lens), max(seq_lens)
        lens = torch.tensor(seq_lens, device=x.device)
        # row of each token in the padded [b * longest] layout, and which keys each sequence may see
        starts = torch.arange(b, device=x.device).repeat_interleave(lens) * longest
        pad_index = starts + positions
        key_mask = (torch.arange(longest, device=x.device)[None, :] < lens[:, None])[:, None, None, :]
        for layer in self.layers:
            x = layer(x, pad_index, key_mask, (b, longest))
        return x

    _RENAME: ClassVar[dict[str, str]] = {
        "embeddings.word_embeddings": "word_embeddings",
        "embeddings.position_embeddings": "position_embeddings",
        "embeddings.token_type_embeddings": "token_type_embeddings",
        "embeddings.LayerNorm": "embed_norm",
        "attention.output.dense": "attn_out",
        "attention.output.LayerNorm": "attn_norm",
        "intermediate.dense": "intermediate",
        "output.dense": "output",
        "output.LayerNorm": "out_norm",
    }
    _QKV: ClassVar[dict[str, int]] = {"attention.self.query": 0, "attention.self.key": 1, "attention.self.value": 2}

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        h = self.config.hidden_size
        for name, tensor in weights:
            name = name.removeprefix("bert.").removeprefix("model.")
            if name.startswith(("pooler.", "cls.")) or name.endswith("position_ids"):
                continue  # the pooler head and MLM head are not used for sentence embeddings
            if name.startswith("encoder.layer."):
                _, _, idx, rest = name.split(".", 3)
                module, kind = rest.rsplit(".", 1)
                if module in self._QKV:
                    target = f"layers.{idx}.qkv.{kind}"
                    i = self._QKV[module]
                    params[target].data[i * h : (i + 1) * h].copy_(tensor)
                    loaded.add(f"{target}#{i}")
                    continue
                if module not in self._RENAME:
                    raise UnsupportedModelError(f"checkpoint has unexpected weight {name!r} for BertModel")
                target = f"layers.{idx}.{self._RENAME[module]}.{kind}"
            else:
                module, kind = name.rsplit(".", 1)
                if module not in self._RENAME:
                    raise UnsupportedModelError(f"checkpoint has unexpected weight {name!r} for BertModel")
                target = f"{self._RENAME[module]}.{kind}"
            if params[target].shape != tensor.shape:
                raise UnsupportedModelError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[target].shape)}"
                )
            params[target].data.copy_(tensor)
            loaded.add(target)
        expected = [f"{n}#{i}" for n in params if ".qkv." in n for i in range(3)] + [
            n for n in params if ".qkv." not in n
        ]
        missing = [n for n in expected if n not in loaded]
        if missing:
            raise UnsupportedModelError(f"checkpoint is missing weights: {missing[:8]}")
        return loaded
