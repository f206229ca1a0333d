"""DFlash on the drafter protocol: the draft network over paged context K/V that the Thinker's own
steps write (`absorb`), one block forward for every drafting row of a step (`propose`), proposals
drawn the way the Thinker will draw those positions (coupled drafting).

The draft's KV pool has the Thinker pool's pages (same page ids, same block tables, its own
tensors and bytes): position p of a sequence has its draft context at the slot of its Thinker
K/V. So the draft's KV is paged with the Thinker's, freed with its request, cropped with its
rejected drafts, preempted with it, and a prefix-cache hit finds the draft's context for the
cached blocks under the same keys (written by the step that computed them): nothing to recompute.
`settle` therefore has no state to crop. Its bytes are charged to the Thinker's KV budget
(`kv_bytes`, `models/qwen3_omni/stages/graph.py`).
"""
from __future__ import annotations

from pathlib import Path

import torch

from omnivox.kv_cache.pool import KVPool
from omnivox.sampling.batched import sample
from omnivox.speculative.coupled import draw, penalty_seen
from omnivox.speculative.dflash.config import DFlashConfig
from omnivox.speculative.fit import read_weights, refuse_leftovers
from omnivox.speculative.dflash.model import BlockLayout, DFlashDraft
from omnivox.speculative.drafter import Drafter, DraftRow, DraftSampling, Proposals


def load_draft(folder: Path, thinker_cfg, dtype: torch.dtype, device: torch.device | str) -> DFlashDraft:
    """A DFlash checkpoint folder (config.json, *.safetensors) checked against the Thinker's text
    config, on `device` in `dtype`. Raises DraftMismatch naming what does not fit."""
    folder = Path(folder)
    cfg = DFlashConfig.load(folder)
    cfg.check(thinker_cfg)
    draft = DFlashDraft(cfg)
    refuse_leftovers(folder, *draft.load_state_dict(read_weights(folder), strict=False))
    return draft.to(device=device, dtype=dtype).eval()


class DFlashDrafter(Drafter):
    method = "dflash"

    def __init__(self, draft: DFlashDraft, embed: torch.nn.Module, head: torch.nn.Module):
        """`embed`, `head`: the Thinker's token embedding and LM head (the draft has neither)."""
        self.draft, self.embed, self.head = draft, embed, head
        self.cfg = draft.cfg
        self.taps = tuple(self.cfg.target_layer_ids)
        self.pool: KVPool | None = None
        w = draft.fc.weight
        self.device, self.dtype = w.device, w.dtype

    def wants_sampling(self) -> bool:
        return True

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one page of the draft's KV (all its layers)."""
        c = self.cfg
        return KVPool.bytes_per_block(c.num_hidden_layers, block_size, c.num_key_value_heads, c.head_dim, self.dtype)

    def bind_pages(self, num_blocks: int, block_size: int) -> None:
        """Allocate the draft's pool for the Thinker pool's pages (and its dummy page)."""
        c = self.cfg
        self.pool = KVPool(c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim,
                           self.dtype, self.device)

    def kv_bytes(self) -> int:
        return 0 if self.pool is None else self.pool.k.numel() * self.pool.k.element_size() * 2

    def absorb(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.draft.write_context(features, positions, slots, self.pool)

    @torch.no_grad()
    def propose(self, rows: list[DraftRow], sampling: DraftSampling | None) -> Proposals:
        block = self.cfg.block_size
        width = sampling.width if sampling is not None else max(r.k for r in rows)
        if width > block - 1:
            raise ValueError(f"DFlash proposes at most block_size - 1 = {block - 1} ids, asked for {width}")
        pool = self.pool
        lay = BlockLayout.build([r.block_table for r in rows], [r.computed for r in rows], block, pool.block_size,
                                pool.dummy_slot, self.dtype, self.device)
        ids = torch.tensor([[r.anchor] + [self.cfg.mask_token_id] * (block - 1) for r in rows], device=self.device)
        x = self.embed(ids)
        if self.cfg.input_embedding_scale != 1.0:
            x = x * self.cfg.input_embedding_scale
        hidden = self.draft.block(x, pool, lay)[:, 1:1 + width]  # [R, K, H]: position j proposes the j-th id
        logits = self.draft.logits(hidden, self.head)  # [R, K, V] fp32
        drawn = self._draw(logits, sampling)
        counts = [min(r.k, width) for r in rows]
        limit = torch.tensor(counts, device=self.device)[:, None]
        drawn = torch.where(torch.arange(width, device=self.device)[None] < limit, drawn, -1)
        probs = logits.softmax(-1).gather(-1, drawn.clamp_min(0)[..., None])[..., 0]
        return Proposals(drawn, counts, probs)

    def _draw(self, logits: torch.Tensor, s: DraftSampling | None) -> torch.Tensor:
        """[R, K, V] -> [R, K] ids: argmax without sampling values; else each position drawn as the
        Thinker's sample there (same noise step, warping, penalty and suppression), the penalty's
        seen ids growing with the proposals before it."""
        rows, width, vocab = logits.shape
        if s is None:
            return logits.argmax(-1)
        seen = penalty_seen(s)
        if seen is None:  # no penalty: every position at once
            return sample(logits.reshape(rows * width, vocab), s.tensors, s.stream, suppress=s.suppress).view(rows, width)
        return torch.stack([draw(logits[:, j], s, j, seen) for j in range(width)], dim=1)
