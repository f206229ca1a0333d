"""Qwen3-Omni vision encoder (`thinker.visual`, spec section 6.2): ViT with 2x2 patch merging and
deepstack side outputs.

Input rows are patches in merge-block order (see `image_processor`), items (images or videos)
concatenated in the order of `grids`. Attention is bidirectional within one temporal slice of one
item: the h*w patches of a slice see each other and nothing else.

Numerics mirror transformers 5.24: position-interpolation weights and the 2-D rotary are computed
in fp32 whatever the model dtype (q and k are cast to fp32 for the rotation and back).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.layers.rotary import apply_rotary, inv_freq
from omnivox.models.qwen3_omni.config import VisionEncoderConfig

Grid = tuple[int, int, int]
LN_EPS = 1e-6


def merge_block_rows_cols(h: int, w: int, m: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each patch of an h x w frame, listed in merge-block order: [h*w] each."""
    rows = torch.arange(h, device=device)[:, None].expand(h, w)
    cols = torch.arange(w, device=device)[None, :].expand(h, w)
    return _block_order(rows, m), _block_order(cols, m)


def _block_order(a: torch.Tensor, m: int) -> torch.Tensor:
    """[h, w] raster -> [h*w] listed as (h/m, w/m, m, m)."""
    h, w = a.shape
    return a.reshape(h // m, m, w // m, m).transpose(1, 2).flatten()


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear align-corners taps [n, 2] into a `side`-long table and their fp32 weights [n, 2]."""
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class PatchMerger(nn.Module):
    """Four neighbouring patches -> one token. `postshuffle` norms the concatenated 4*D vector
    (deepstack mergers); otherwise each patch is normed first (final merger)."""

    def __init__(self, hidden: int, merge_size: int, out_hidden: int, postshuffle: bool):
        super().__init__()
        self.merged = hidden * merge_size * merge_size
        self.postshuffle = postshuffle
        self.ln_q = nn.LayerNorm(self.merged if postshuffle else hidden, eps=LN_EPS)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged), nn.GELU(), nn.Linear(self.merged, out_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N/4, out]
        x = self.ln_q(x.view(-1, self.merged)) if self.postshuffle else self.ln_q(x).view(-1, self.merged)
        return self.mlp(x)


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).permute(1, 2, 0, 3)  # each [H, N, D]
        # NOTE: fp32 island, also for fp64 models (the reference casts q and k down and back).
        q = apply_rotary(q[None].float(), cos[None], sin[None])[0].to(x.dtype)
        k = apply_rotary(k[None].float(), cos[None], sin[None])[0].to(x.dtype)
        out, start = [], 0
        for t, h, w in grids:
            end = start + t * h * w
            seg = [a[:, start:end].reshape(self.heads, t, h * w, self.head_dim).transpose(0, 1) for a in (q, k, v)]
            o = F.scaled_dot_product_attention(*seg)  # [t, H, hw, D], one temporal slice per batch row
            out.append(o.transpose(1, 2).reshape(t * h * w, -1))
            start = end
        return self.proj(torch.cat(out))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, intermediate)
        self.linear_fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=LN_EPS)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=LN_EPS)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = VisionMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, grids)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """Conv3d with kernel = stride = (tp, p, p): a Linear on the flattened (C, tp, p, p) patch."""

    def __init__(self, cfg: VisionEncoderConfig):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, C*tp*p*p] -> [N, D]
        w = self.proj.weight
        return F.linear(pixel_values.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionEncoder(nn.Module):
    """Module names equal the checkpoint's `thinker.visual.*` names; no buffers (tables are recomputed)."""

    def __init__(self, cfg: VisionEncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.side = int(round(cfg.num_position_embeddings ** 0.5))
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg.hidden_size, cfg.spatial_merge_size, cfg.out_hidden_size, postshuffle=False)
        self.merger_list = nn.ModuleList(
            PatchMerger(cfg.hidden_size, cfg.spatial_merge_size, cfg.out_hidden_size, postshuffle=True)
            for _ in cfg.deepstack_visual_indexes)

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values [N, C*tp*p*p], grids (t, h, w) per item in row order ->
        (merged tokens [N/4, out_hidden], one [N/4, out_hidden] per deepstack index, in block order)."""
        grids = [tuple(int(v) for v in g) for g in grids]
        self._check(pixel_values, grids)
        rows, cols = self._patch_rows_cols(grids, pixel_values.device)  # [N] each
        x = self.patch_embed(pixel_values)  # [N, D]
        x = x + self._position_embedding(rows, cols, grids).to(x.dtype)
        cos, sin = self._rotary(rows, cols)  # [N, head_dim] fp32
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, grids)
            if i in self.cfg.deepstack_visual_indexes:
                deepstack.append(self.merger_list[self.cfg.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack

    def _check(self, pixel_values: torch.Tensor, grids: list[Grid]) -> None:
        m = self.cfg.spatial_merge_size
        if any(h % m or w % m for _, h, w in grids):
            raise ValueError(f"grid h and w must be multiples of the merge size {m}: {grids}")
        if sum(t * h * w for t, h, w in grids) != pixel_values.shape[0]:
            raise ValueError(f"grids {grids} cover a different number of patches than {pixel_values.shape[0]}")

    def _patch_rows_cols(self, grids: list[Grid], device) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = [], []
        for t, h, w in grids:
            r, c = merge_block_rows_cols(h, w, self.cfg.spatial_merge_size, device)
            rows.append(r.repeat(t))
            cols.append(c.repeat(t))
        return torch.cat(rows), torch.cat(cols)

    def _position_embedding(self, rows: torch.Tensor, cols: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """Learned side x side grid, bilinearly resampled (align corners) to each item's h x w: [N, D]."""
        sizes = [t * h * w for t, h, w in grids]
        taps, weights = [], []
        for (_, h, w), r, c in zip(grids, rows.split(sizes), cols.split(sizes)):
            h_taps, h_wts = _axis_taps(r, h, self.side)  # [n, 2]
            w_taps, w_wts = _axis_taps(c, w, self.side)
            taps.append((h_taps[:, :, None] * self.side + w_taps[:, None, :]).reshape(-1, 4))
            weights.append((h_wts[:, :, None] * w_wts[:, None, :]).reshape(-1, 4))
        taps, weights = torch.cat(taps), torch.cat(weights)  # [N, 4]; weights fp32 as in the reference
        return (self.pos_embed(taps) * weights[:, :, None]).sum(1)

    def _rotary(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """2-D rotary: angles [row * inv | col * inv], repeated twice over the head dim (fp32)."""
        # Recomputed per call (a few values) so a model-wide .to(dtype) cannot round it.
        freqs = inv_freq(self.cfg.hidden_size // self.cfg.num_heads // 2, self.cfg.rope_theta, rows.device)
        angles = torch.cat((rows.float()[:, None] * freqs, cols.float()[:, None] * freqs), dim=-1)
        emb = torch.cat((angles, angles), dim=-1)  # [N, head_dim]
        return emb.cos(), emb.sin()
