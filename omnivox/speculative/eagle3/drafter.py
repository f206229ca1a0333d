"""EAGLE-3 on the drafter protocol: `k` chained draft steps for every drafting row of a Thinker
step at once (a chain, not a tree: trees are out of scope), each drawn the way the Thinker will
draw that position (coupled drafting) and mapped to the Thinker's ids through `d2t`.

What the head keeps lives in the Thinker pool's pages (same page ids, its own tensors): at the
slot of position p, the fused target feature fc(features of p) (`absorb`, inside the Thinker's
step, for every token it computes) and the K/V of the head's entry for index p - 1 (the token at
p with the feature of p - 1: a function of positions 0..p only, so a page shared by a prefix-cache
hit holds the same entries whoever wrote them). Entries are made lazily from the stored features
when a row drafts (`propose`: the positions it gained since its last draft; a new or preempted
row, its whole past once: recomputed, not looked up), never from a draft's own states: a
chain's own steps stay in temporaries. So a rejected draft leaves nothing to crop; `settle`
only forgets how far a row's entries reach (preemption, finish).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from omnivox.kv_cache.pool import KVPool
from omnivox.layers.attention import additive_mask, masked_attention
from omnivox.speculative.coupled import draw, penalty_seen
from omnivox.speculative.drafter import Drafter, DraftRow, DraftSampling, Proposals
from omnivox.speculative.eagle3.config import SPECULATORS, Eagle3Config
from omnivox.speculative.eagle3.model import Eagle3Head
from omnivox.speculative.fit import DraftMismatch, read_weights, refuse_leftovers


def load_head(folder: Path, thinker_cfg, dtype: torch.dtype, device: torch.device | str) -> tuple[Eagle3Head, dict]:
    """An EAGLE-3 checkpoint folder (config.json, *.safetensors; either layout) checked against
    the Thinker's text config -> (the head on `device` in `dtype`, the checkpoint's own
    `embed_tokens` weights if it has them, else {}). Raises DraftMismatch naming what does not fit."""
    folder = Path(folder)
    cfg = Eagle3Config.load(folder)
    cfg.check(thinker_cfg)
    tensors = read_weights(folder)
    if cfg.layout == SPECULATORS:
        tensors = {k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k: v
                   for k, v in tensors.items()}
    embed = {k: tensors.pop(k) for k in [k for k in tensors if k.startswith("embed_tokens.")]}
    tensors = {k: v for k, v in tensors.items() if not k.startswith(("verifier_", "input_norm."))}
    if "d2t" not in tensors and cfg.draft_vocab_size < cfg.vocab_size:
        raise DraftMismatch(f"draft weights in {folder}: no d2t for a draft vocabulary of {cfg.draft_vocab_size} "
                            f"< {cfg.vocab_size}")
    taps = len(cfg.taps(thinker_cfg.num_hidden_layers))
    head = Eagle3Head(cfg, taps)
    fc = tensors.get("fc.weight")
    if fc is not None and tuple(fc.shape) != tuple(head.fc.weight.shape):
        raise DraftMismatch(f"draft fc.weight is {list(fc.shape)} but {taps} target layers of hidden size "
                            f"{thinker_cfg.hidden_size} need {list(head.fc.weight.shape)}")
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    refuse_leftovers(folder, [k for k in missing if k not in ("d2t", "t2d")], unexpected)
    return head.to(device=device, dtype=dtype).eval(), embed


class ChainLayout:
    """Host-made indices of one `propose` call (vectorised numpy, one copy each):
    - `fill_*` [E]: the head's entries to make now (index q - 1 for position q: the token at q,
      the feature at slot(q - 1), written at slot(q)), the positions each row gained;
    - `ctx_index` [R * T], `ctx_mask` [R, 1, 1, T]: each row's entries for positions 1..n - 1
      (n = its computed positions), padding at the dummy slot, masked;
    - `anchor_feat` [R]: slot(n - 1), the feature the chain's first step reads."""

    def __init__(self, rows: list[DraftRow], reach: list[int], block_size: int, dummy_slot: int,
                 dtype: torch.dtype, device: torch.device | str):
        n = np.asarray([r.computed for r in rows], dtype=np.int64)
        width = max(int(n.max()) - 1, 1)
        t = np.arange(width)
        ctx = np.full((len(rows), width), dummy_slot, dtype=np.int64)
        fill_tok, fill_feat, fill_slot, fill_pos, anchor = [], [], [], [], []
        for i, (r, lo) in enumerate(zip(rows, reach)):
            table = np.asarray(r.block_table, dtype=np.int64)
            pos = np.arange(r.computed)
            slot = table[pos // block_size] * block_size + pos % block_size  # [n]
            ctx[i, :r.computed - 1] = slot[1:]
            q = np.arange(max(lo, 1), r.computed)
            fill_tok.append(np.asarray(r.tokens, dtype=np.int64)[q])
            fill_feat.append(slot[q - 1])
            fill_slot.append(slot[q])
            fill_pos.append(q - 1)
            anchor.append(slot[r.computed - 1])
        as_t = lambda a: torch.from_numpy(np.concatenate(a) if isinstance(a, list) else a).to(device)  # noqa: E731
        self.fill_tokens, self.fill_features, self.fill_slots, self.fill_positions = (
            as_t(fill_tok), as_t(fill_feat), as_t(fill_slot), as_t(fill_pos))
        self.ctx_index = as_t(ctx.reshape(-1))
        self.ctx_mask = additive_mask(torch.from_numpy(t[None] < (n - 1)[:, None]).to(device), dtype)[:, None, None, :]
        self.anchor_features = as_t(np.asarray(anchor, dtype=np.int64))
        self.width = width


class Eagle3Drafter(Drafter):
    method = "eagle3"

    def __init__(self, head: Eagle3Head, embed: torch.nn.Module, taps: tuple[int, ...]):
        """`embed`: the token embedding (the Thinker's, or the checkpoint's own); `taps`: the
        Thinker layers `fc` fuses (`Eagle3Config.taps`)."""
        self.head, self.embed, self.taps = head, embed, tuple(taps)
        w = head.fc.weight
        self.device, self.dtype = w.device, w.dtype
        self.pool: KVPool | None = None
        self.features: torch.Tensor | None = None  # [slots, H] fc(target features) per position
        self.reach: dict[str, int] = {}  # rid -> entries made for positions 1..reach - 1

    def wants_sampling(self) -> bool:
        return True

    def bind_pages(self, num_blocks: int, block_size: int) -> None:
        c = self.head.cfg
        self.pool = KVPool(1, num_blocks, block_size, c.num_key_value_heads, c.head_dim, self.dtype, self.device)
        self.features = torch.zeros((num_blocks + 1) * block_size, c.hidden_size, dtype=self.dtype, device=self.device)

    def kv_bytes(self) -> int:
        if self.pool is None:
            return 0
        return (self.pool.k.numel() * 2 + self.features.numel()) * self.pool.k.element_size()

    def absorb(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.features.index_copy_(0, slots, self.head.fuse(features))

    def settle(self, kept: dict[str, int]) -> None:
        for rid, n in kept.items():
            if n <= 0:
                self.reach.pop(rid, None)
            elif rid in self.reach:
                self.reach[rid] = min(self.reach[rid], n)

    @torch.no_grad()
    def propose(self, rows: list[DraftRow], sampling: DraftSampling | None) -> Proposals:
        head, pool = self.head, self.pool
        width = sampling.width if sampling is not None else max(r.k for r in rows)
        lay = ChainLayout(rows, [self.reach.get(r.rid, 0) for r in rows], pool.block_size, pool.dummy_slot,
                          self.dtype, self.device)
        if lay.fill_tokens.numel():  # the entries of the positions gained since the row last drafted
            _, k, v, _ = head.project(self.embed(lay.fill_tokens), self.features[lay.fill_features], lay.fill_positions)
            pool.k[0].index_copy_(0, lay.fill_slots, k)
            pool.v[0].index_copy_(0, lay.fill_slots, v)
        R, c = len(rows), head.cfg
        keys = [pool.k[0].index_select(0, lay.ctx_index).view(R, lay.width, c.num_key_value_heads, c.head_dim)]
        values = [pool.v[0].index_select(0, lay.ctx_index).view(R, lay.width, c.num_key_value_heads, c.head_dim)]
        token = torch.tensor([r.anchor for r in rows], device=self.device)
        hidden = self.features[lay.anchor_features]  # [R, H]
        position = torch.tensor([r.computed - 1 for r in rows], device=self.device)
        seen, drawn, probs = penalty_seen(sampling), [], []
        for j in range(width):  # the chain: step j proposes the id after position computed + j
            q, k, v, residual = head.project(self.embed(token.clamp_min(0)), hidden, position + j)
            keys.append(k[:, None])
            values.append(v[:, None])
            mask = torch.nn.functional.pad(lay.ctx_mask, (0, j + 1))  # the chain's own entries: 0 = attend
            out = masked_attention(q[:, None], torch.cat(keys, 1), torch.cat(values, 1), mask)[:, 0]
            hidden = head.finish(out, residual)
            logits = head.to_target(head.logits(hidden))  # [R, V] fp32
            token = draw(logits, sampling, j, seen)
            drawn.append(token)
            probs.append(logits.softmax(-1).gather(-1, token.clamp_min(0)[:, None])[:, 0])
        for r in rows:
            self.reach[r.rid] = r.computed
        counts = [min(r.k, width) for r in rows]
        ids = torch.stack(drawn, dim=1)
        ids = torch.where(torch.arange(width, device=self.device)[None] < torch.tensor(counts, device=self.device)[:, None],
                          ids, -1)
        return Proposals(ids, counts, torch.stack(probs, dim=1))
