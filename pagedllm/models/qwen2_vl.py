"""Qwen2-VL and Qwen2.5-VL (transformers' ``Qwen2VLForConditionalGeneration``,
``Qwen2_5_VLForConditionalGeneration``): images at their own resolution, a ViT with 2-D
rotary positions over 14-pixel patches, a 2×2 patch merger into the text model's width, and M-RoPE in the text
model: each image token's rotary position is (t, h, w) on the image's grid, text tokens' the same number three
times.

How positions reach the model: :meth:`Qwen2VLForConditionalGeneration.mrope_positions` computes a prompt's
``[3, prompt length]`` table and its delta once, when the runner first sees the request (transformers'
``get_rope_index``); a step's rows in the prompt take their column, later tokens ``position + delta`` in all
three rows. A step with no image rows in its prompt chunks gets ordinary 1-D positions (shifted by the delta),
so decoding runs the text model's paths as they are, the fused decode loop included.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import ParallelState
from pagedllm.errors import UnsupportedModelError
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from pagedllm.models.vision import VisionMLP, activation
from pagedllm.models.vlm import VisionLanguageModel, load_module


class Qwen2VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        """``x``: ``[B, n, dim]``, B images of one grid; ``groups``: ``[G, L]`` index tensors into the n rows,
        each row attending only among its L (a frame, or a window); ``cos``/``sin``: ``[n, 1, head_dim / 2]``."""
        b, n, dim = x.shape
        h, d = self.num_heads, self.head_dim
        q, k, v = self.qkv(x).view(b * n, 3, h, d).unbind(1)
        cos, sin = cos.repeat(b, 1, 1), sin.repeat(b, 1, 1)
        q, k = apply_rotary(q.contiguous(), cos, sin), apply_rotary(k.contiguous(), cos, sin)
        q, k, v = (t.view(b, n, h, d) for t in (q, k, v))
        if len(groups) == 1 and groups[0].shape[0] == 1:  # one group of every row: no gather
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=d**-0.5)
            return self.proj(o.transpose(1, 2).reshape(b, n, dim))
        out = torch.empty_like(q)
        for idx in groups:
            g, length = idx.shape
            flat = idx.reshape(-1).to(x.device)
            qg, kg, vg = (t[:, flat].reshape(b * g, length, h, d).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qg, kg, vg, scale=d**-0.5)
            out[:, flat] = o.transpose(1, 2).reshape(b, g * length, h, d)
        return self.proj(out.view(b, n, dim))


class GatedVisionMLP(nn.Module):
    """Qwen2.5-VL's: gate, up and down projections with biases."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Qwen2VisionBlock(nn.Module):
    def __init__(self, vc: Any, dim: int, v2_5: bool):
        super().__init__()
        self.norm1, self.norm2 = (RMSNorm(dim, 1e-6) if v2_5 else nn.LayerNorm(dim, eps=1e-6) for _ in range(2))
        self.attn = Qwen2VisionAttention(dim, vc.num_heads)
        self.mlp: nn.Module = (
            GatedVisionMLP(dim, vc.intermediate_size, vc.hidden_act)
            if v2_5
            else VisionMLP(dim, int(dim * vc.mlp_ratio), vc.hidden_act)
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        b, n, dim = x.shape
        x = x + self.attn(self.norm1(x.reshape(b * n, dim)).view(b, n, dim), cos, sin, groups)
        return x + self.mlp(self.norm2(x.reshape(b * n, dim))).view(b, n, dim)


class PatchEmbed(nn.Module):
    def __init__(self, channels: int, dim: int, kernel: tuple[int, int, int]):
        super().__init__()
        self.proj = nn.Conv3d(channels, dim, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(self.proj.weight.dtype))


class PatchMerger(nn.Module):
    """A norm (Qwen2.5-VL's RMSNorm, Qwen2-VL's layernorm), then each 2×2 block's four patches side by side
    through a two-layer MLP."""

    def __init__(self, dim: int, merge: int, out_dim: int, v2_5: bool):
        super().__init__()
        self.merged = dim * merge**2
        self.ln_q: nn.Module = RMSNorm(dim, 1e-6) if v2_5 else nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged), nn.GELU(), nn.Linear(self.merged, out_dim))
        self.out_dim = out_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class Qwen2VisionTransformer(nn.Module):
    """transformers' ``Qwen2VisionTransformerPretrainedModel`` and, with ``v2_5``,
    ``Qwen2_5_VisionTransformerPretrainedModel``: 3-D patch embedding (two frames of 14×14 pixels: an image is
    its frame twice), 2-D rotary positions laid out in 2×2 merge blocks, pre-norm blocks, and the patch merger
    (four patches' features side by side, a two-layer MLP into the text width).

    Qwen2.5-VL's blocks are RMSNorm and gated-MLP ones, and all but its ``fullatt_block_indexes`` attend within
    windows of ``window_size`` pixels: its rows are put in window order (whole merge blocks move) before the
    blocks, and the merged tokens back in the image's order after the merger."""

    def __init__(self, vc: Any, out_dim: int, v2_5: bool = False):
        super().__init__()
        self.channels, self.patch, self.frames = vc.in_channels, vc.patch_size, vc.temporal_patch_size
        self.merge = vc.spatial_merge_size
        dim = self.dim = vc.hidden_size if v2_5 else vc.embed_dim
        head_dim = dim // vc.num_heads
        self.patch_embed = PatchEmbed(self.channels, dim, (self.frames, self.patch, self.patch))
        self.blocks = nn.ModuleList(Qwen2VisionBlock(vc, dim, v2_5) for _ in range(vc.depth))
        self.merger = PatchMerger(dim, self.merge, out_dim, v2_5)
        self.window = vc.window_size // self.merge // self.patch if v2_5 else 0  # in merged tokens
        self.full_attention = set(vc.fullatt_block_indexes) if v2_5 else set(range(vc.depth))
        theta = float((getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        spatial = head_dim // 2  # half the rotated pairs turn with the row, half with the column
        self.inv_freq = 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial)

    def rotary(self, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[patches, 1, head_dim / 2]`` tables: each patch's row angles then its column angles, patches in
        the processor's order (2×2 merge blocks, row-major within each)."""
        t, h, w = grid
        m = self.merge
        hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        hpos, wpos = (p.reshape(h // m, m, w // m, m).transpose(1, 2).flatten() for p in (hpos, wpos))
        angles = torch.cat([torch.outer(hpos.float(), self.inv_freq), torch.outer(wpos.float(), self.inv_freq)], -1)
        angles = angles.repeat(t, 1).unsqueeze(1)
        return angles.cos(), angles.sin()

    def windows(self, grid: tuple[int, int, int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Qwen2.5-VL's window order of the merged tokens (transformers' ``get_vision_window_index``: windows of
        ``window``×``window`` merged tokens, row-major, the last row and column of windows cut short), and the
        windows as index groups over the patch rows in that order, windows of one size together."""
        t, h, w = grid
        gh, gw, ws = h // self.merge, w // self.merge, self.window
        order, sizes = [], []
        for frame in range(t):
            index = torch.arange(frame * gh * gw, (frame + 1) * gh * gw).view(gh, gw)
            for r in range(0, gh, ws):
                for c in range(0, gw, ws):
                    cell = index[r : r + ws, c : c + ws].reshape(-1)
                    order.append(cell)
                    sizes.append(cell.numel() * self.merge**2)
        by_size: dict[int, list[torch.Tensor]] = {}
        start = 0
        for size in sizes:
            by_size.setdefault(size, []).append(torch.arange(start, start + size))
            start += size
        return torch.cat(order), [torch.stack(rows) for rows in by_size.values()]

    def forward(self, pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """``[B, patches, channels × frames × 14 × 14]`` (B images of one grid) → ``[B, patches / 4, out_dim]``."""
        b, n, _ = pixel_values.shape
        t, h, w = grid
        unit = self.merge**2
        if n != t * h * w or h % self.merge or w % self.merge:
            raise UnsupportedModelError(f"an image of {n} patches reached the tower with the grid {grid}")
        x = self.patch_embed(pixel_values.reshape(-1, self.channels, self.frames, self.patch, self.patch))
        x = x.view(b, n, self.dim)
        cos, sin = (c.to(x.device) for c in self.rotary(grid))
        frames = [torch.arange(n).view(t, n // t)]  # each frame attends to itself
        windows, order = frames, None
        if self.window:
            order, windows = self.windows(grid)
            rows = (order.view(-1, 1) * unit + torch.arange(unit)).view(-1)  # whole merge blocks move
            x, cos, sin = x[:, rows.to(x.device)], cos[rows], sin[rows]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in self.full_attention else windows)
        out = self.merger(x.reshape(b * n, self.dim)).view(b, n // unit, -1)
        if order is not None:
            out = out[:, torch.argsort(order).to(out.device)]
        return out


class MRotaryEmbedding(RotaryEmbedding):
    """The text model's rotary tables for 1-D positions as usual, and for ``[3, T]`` M-RoPE positions: the
    first ``mrope_section[0]`` frequencies turn with the temporal position, the next ``[1]`` with the row, the
    last ``[2]`` with the column."""

    def __init__(self, head_dim: int, params: dict[str, Any]):
        super().__init__(head_dim, params)
        section = list(params.get("mrope_section") or [])
        if sum(section) != head_dim // 2 or len(section) != 3 or min(section) < 0:
            raise UnsupportedModelError(
                f"mrope_section={section} must be three counts adding up to head_dim / 2 ({head_dim // 2})"
            )
        self.section_of = torch.repeat_interleave(torch.arange(3), torch.tensor(section))  # [D/2]: 0, 1 or 2

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().cos_sin(positions)
        # frequency j turns with position component section_of[j]: [T, D/2] positions, each by its frequency
        picked = positions.index_select(0, self.section_of.to(positions.device)).t().contiguous()  # the C rotary's
        freqs = (picked.to(torch.float32) * self.inv_freq.to(positions.device)).unsqueeze(1)
        return freqs.cos(), freqs.sin()


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    """The Qwen2-VL half of ``Qwen2VLForConditionalGeneration[<text class>]`` (the text model is Qwen2's)."""

    VISION_PREFIXES = ("visual.",)
    uses_mrope = True
    v2_5 = False  # Qwen2.5-VL's tower (windowed attention, RMSNorm, gated MLPs)

    def __init__(self, cfg: Any, parallel: ParallelState | None = None):
        super().__init__(cfg, parallel)
        mm = cfg.multimodal_config
        self.merge = int(mm.vision_config.spatial_merge_size)
        params = rope_parameters(cfg)
        head_dim = cast(Any, self)._attention().head_dim  # the text class's
        self.rotary = MRotaryEmbedding(head_dim, params)
        self.visual: Qwen2VisionTransformer | None = None
        if self.ps.is_first_stage:
            vc = mm.vision_config
            out_dim = vc.out_hidden_size if self.v2_5 else vc.hidden_size
            self.visual = Qwen2VisionTransformer(vc, out_dim, self.v2_5)
            if self.visual.merger.out_dim != cfg.hidden_size:
                raise UnsupportedModelError(
                    f"the patch merger gives {self.visual.merger.out_dim} features, the text model takes "
                    f"{cfg.hidden_size}"
                )

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int] | None = None) -> torch.Tensor:
        assert self.visual is not None and grid_thw is not None, "a Qwen2-VL image comes with its grid"
        return self.visual(pixel_values, grid_thw)

    def mrope_positions(self, num_prompt_tokens: int, features: list[Any]) -> tuple[torch.Tensor, int]:
        """A prompt's ``[3, num_prompt_tokens]`` M-RoPE positions and its delta (the position of token ``i``
        after the prompt is ``i + delta``), as transformers' ``get_rope_index`` computes them: text runs count
        on from the last position, an image's tokens take ``start + (t, row, column)`` on its merged grid and
        move the count on by its larger side."""
        parts: list[torch.Tensor] = []
        cur = last = 0
        for f in sorted(features, key=lambda f: f.offset):
            parts.append(torch.arange(f.offset - last).expand(3, -1) + cur)
            cur += f.offset - last
            t, h, w = f.grid_thw
            h, w = h // self.merge, w // self.merge
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
            parts.append(grid.reshape(3, -1) + cur)
            cur += max(h, w)
            last = f.end
        parts.append(torch.arange(num_prompt_tokens - last).expand(3, -1) + cur)
        cur += num_prompt_tokens - last
        return torch.cat(parts, dim=1), cur - num_prompt_tokens

    def load_vision_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        assert self.visual is not None
        tower = {n.removeprefix("visual."): t for n, t in weights}
        return {f"visual.{n}" for n in load_module(self.visual, tower, "vision tower")}


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: Qwen2-VL's M-RoPE text model and processing, its own tower (see
    :class:`Qwen2VisionTransformer`)."""

    v2_5 = True
