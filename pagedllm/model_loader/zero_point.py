"""Checkpoints quantized with zero points (AWQ, GPTQ): what the formats share (FP8 reuses the reading).

The formats subclass :class:`ZeroPointCheckpoint`; :func:`pagedllm.model_loader.quant_config.checkpoint_scheme`
picks one by the checkpoint's ``quantization_config``.

Each format unpacks one linear's tensors into ``q [out, in]``, ``zeros [out, groups]``,
``scales [out, groups]`` and its group size, with ``W = (q - zeros) * scales`` per group; from
there the weights are the same thing: the int4 / int8 blocks
(:func:`pagedllm.layers.quantization.zero_point_blocks`) that the model's linears take as they are,
read first (:meth:`ZeroPointCheckpoint.read_blocks`), and dequantized float32 weights
(:meth:`ZeroPointCheckpoint.iter_float`) only for a linear that cannot take its block.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Any

import torch

from pagedllm.errors import UnsupportedModelError


class ZeroPointCheckpoint:
    name: str  # the format, for messages
    parts: tuple[str, ...]  # the tensors every quantized linear has
    optional: tuple[str, ...] = ()
    bits: int

    @property
    def method(self) -> str:
        """The engine's quantization for this checkpoint: its own bits."""
        return f"int{self.bits}"

    def unpack(self, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(q [N, K], zeros [N, G], scales [N, G], group) of one linear."""
        raise NotImplementedError

    def input_order(self, t: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Where a linear's groups run over its inputs in another order (GPTQ's act-order): the inputs in
        group order (``unpack`` gives q's columns in that order); None where they run in order."""
        return None

    def dequantize(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """float32 [out, in]."""
        q, z, s, group = self.unpack(t)
        w = (q.float() - z.float().repeat_interleave(group, 1)) * s.float().repeat_interleave(group, 1)
        order = self.input_order(t)
        if order is None:
            return w.contiguous()
        out = torch.empty_like(w)
        out[:, order] = w
        return out

    def block(self, t: dict[str, torch.Tensor]) -> tuple[str, tuple[torch.Tensor, ...]]:
        """int4 / int8 groups (:func:`~pagedllm.layers.quantization.zero_point_blocks`); an act-order linear's
        input order rides along as a fourth tensor, [1, in], so fused shards keep one row each."""
        from pagedllm.layers.quantization import zero_point_blocks

        kind, tensors = zero_point_blocks(*self.unpack(t), self.bits)
        order = self.input_order(t)
        return kind, tensors if order is None else (*tensors, order[None, :])

    def read_blocks(
        self, weights: Iterator[tuple[str, torch.Tensor]]
    ) -> dict[str, tuple[str, tuple[torch.Tensor, ...]]]:
        """Each quantized linear's blocks, by weight name (transformers'), never dequantized."""
        return {f"{name}.weight": self.block(value) for name, value in self._modules(weights, plain=False)}

    def iter_float(
        self, weights: Iterator[tuple[str, torch.Tensor]], skip: Collection[str] = ()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint as float32 weights by transformers' names, quantized linears dequantized, but
        for those named in ``skip`` (their layers took their blocks already)."""
        for name, value in self._modules(weights):
            if not isinstance(value, dict):
                yield name, value
            elif f"{name}.weight" not in skip:
                yield f"{name}.weight", self.dequantize(value)

    def _is_quantized_part(self, name: str, part: str, t: torch.Tensor) -> bool:
        """Is checkpoint tensor ``name`` (``module.part``) one of a quantized linear's tensors?"""
        return part in self.parts or part in self.optional

    def _modules(self, weights: Iterator[tuple[str, torch.Tensor]], plain: bool = True) -> Iterator[tuple[str, Any]]:
        """Plain tensors as they come (float32; not with ``plain`` False), then each quantized linear's tensors
        together (packed weights are small: holding them all costs what the file does)."""
        quantized: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in weights:
            module, _, part = name.rpartition(".")
            if self._is_quantized_part(name, part, t):
                quantized.setdefault(module, {})[part] = t
            elif plain and not name.endswith("rotary_emb.inv_freq"):
                yield name, t.to(torch.float32)
        for module, got in quantized.items():
            missing = [p for p in self.parts if p not in got]
            if missing:
                raise UnsupportedModelError(f"{self.name} checkpoint: {module} lacks {missing}")
            yield module, got
