"""Moshi's LM (moshi's `LMModel` + `LMGen.step`): the temporal transformer over the text stream
and 2 x dep_q audio streams with acoustic delays, and the depformer's per-frame loop over the
model's dep_q codebooks. One `step` = one 80 ms frame for a batch of sessions.

Per session the state is data (`LMState`, batch-first): the temporal transformer's KV window
(`lm_kv.WindowKVState`, whose `pos` is the session's frame index) and `tokens`, moshi's ring of
the delayed streams [K = 1 + n_q, max_delay + 2]. A step, per row (LMGen's rules):
 1. write the user's codes of this frame at (pos + delay) of their streams;
 2. read column pos of every stream, or the initial token (text_card / card) where pos <= delay;
 3. temporal transformer -> text logits -> text token; depformer -> dep_q audio codes;
 4. write text + audio at column pos + 1;
 5. output, de-delayed: column pos + 1 - max_delay + delay of the text and model streams; a
    row whose pos + 1 <= max_delay (its first max_delay frames) is not ready (LMGen returns
    None there, and -2 on such rows of a batch).
Sessions join and leave between steps (`LMState.concat` / `select`); every row has its own
position, so a batch equals each session's own run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from omnivox.layers.attention import FrameKVCache
from omnivox.layers.streaming_conv import BatchedState
from omnivox.models.moshi.config import MoshiConfig
from omnivox.models.moshi.lm_kv import WindowKV, WindowKVState
from omnivox.models.moshi.lm_layers import Transformer, ZeroEmbedding, make_norm
from omnivox.models.moshi.lm_sampling import MoshiSampler

UNGENERATED = -2  # moshi's ungenerated_token_id: the output of a row that is not ready yet


@dataclass
class LMState(BatchedState):
    kv: WindowKVState
    tokens: torch.Tensor  # [B, 1 + n_q, max_delay + 2] long: the delayed streams' ring (-2: not written)

    @property
    def frames(self) -> torch.Tensor:
        """[B] frames each session has stepped."""
        return self.kv.pos


@dataclass
class StepOutput:
    tokens: torch.Tensor  # [B, 1 + dep_q] long: text token, then the model's audio codes (de-delayed)
    ready: torch.Tensor  # [B] bool: False on a session's first max_delay frames (tokens are -2 there)


class MoshiLM(nn.Module):
    """Attribute names equal moshi's `LMModel` state-dict keys."""

    def __init__(self, cfg: MoshiConfig):
        super().__init__()
        self.cfg = cfg
        t, d = cfg.transformer, cfg.depformer
        self.emb = nn.ModuleList(ZeroEmbedding(cfg.card + 1, t.dim) for _ in range(cfg.n_q))
        self.text_emb = ZeroEmbedding(cfg.text_card + 1, t.dim)
        self.text_linear = nn.Linear(t.dim, cfg.text_card_out, bias=cfg.bias_proj)
        self.transformer = Transformer(t)
        self.out_norm = make_norm(t.norm, t.dim)
        self.depformer_in = nn.ModuleList(nn.Linear(t.dim, d.dim, bias=False) for _ in range(cfg.depformer_in_count))
        self.depformer_emb = nn.ModuleList(ZeroEmbedding(cfg.card + 1, d.dim) for _ in range(cfg.dep_q - 1))
        self.depformer_text_emb = ZeroEmbedding(cfg.text_card + 1, d.dim)
        self.depformer_norms = nn.ModuleList(
            nn.Identity() if cfg.depformer_norm is None else make_norm(cfg.depformer_norm, d.dim)
            for _ in range(cfg.dep_q))
        self.depformer = Transformer(d)
        self.linears = nn.ModuleList(nn.Linear(d.dim, cfg.card, bias=cfg.bias_proj) for _ in range(cfg.dep_q))
        self._frame = FrameKVCache(d.num_layers, cfg.dep_q, fixed_shape=True)  # the depformer's per-frame K/V

    @property
    def dtype(self) -> torch.dtype:
        return self.text_emb.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.text_emb.weight.device

    # ---- state ------------------------------------------------------------------------------
    def init_state(self, batch: int) -> LMState:
        """Fresh sessions (frame 0); `concat` them onto a running batch to join it."""
        cfg, t = self.cfg, self.cfg.transformer
        if t.context is None:
            raise ValueError("the temporal transformer needs a finite `context` to stream")
        kv = WindowKVState.empty(batch, t.num_layers, t.kv_heads, t.context, t.head_dim, self.dtype, self.device)
        tokens = torch.full((batch, cfg.num_codebooks, cfg.max_delay + 2), UNGENERATED, dtype=torch.long,
                            device=self.device)
        return LMState(kv, tokens)

    # ---- the model ------------------------------------------------------------------------------
    def temporal(self, inputs: torch.Tensor, kv: WindowKVState) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs [B, 1 + n_q] (text, then audio streams) at positions kv.pos -> (hidden after
        out_norm [B, 1, dim], text logits [B, text_card_out]); kv.pos advances by one."""
        x = None
        for i, emb in enumerate(self.emb):  # moshi's summation order: audio streams, then text
            e = emb(inputs[:, i + 1, None])  # [B, 1, dim]
            x = e if x is None else x + e
        x = x + self.text_emb(inputs[:, :1])
        h = self.out_norm(self.transformer(x, kv.pos, WindowKV(kv)))
        return h, self.text_linear(h)[:, 0]

    def depth(self, text: torch.Tensor, h: torch.Tensor, sampler: MoshiSampler | None,
              step: torch.Tensor) -> torch.Tensor:
        """The depformer's frame: text [B], h [B, 1, dim] -> the model's audio codes [B, dep_q]."""
        cfg = self.cfg
        cache = self._frame.rewind()
        prev, codes = text, []
        for cb in range(cfg.dep_q):
            emb = self.depformer_text_emb if cb == 0 else self.depformer_emb[cb - 1]
            x = self.depformer_in[cfg.depformer_in_index(cb)](h) + emb(prev[:, None])  # [B, 1, dep_dim]
            pos = torch.full_like(step, cb)
            y = self.depformer(x, pos, cache, w=cfg.depformer.weight_index(cb))
            logits = self.linears[cb](self.depformer_norms[cb](y))[:, 0].float()  # [B, card]
            prev = logits.argmax(dim=-1) if sampler is None else sampler.audio(logits, cb, step)
            codes.append(prev)
        return torch.stack(codes, dim=1)

    # ---- one frame ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, state: LMState, user_codes: torch.Tensor, sampler: MoshiSampler | None = None) -> StepOutput:
        """One frame for every row of `state`: user_codes [B, user_q] (the user's Mimi codes of
        this frame; extra codebooks are ignored, as LMGen does) -> StepOutput. sampler None: greedy."""
        cfg = self.cfg
        ring = state.tokens
        b, k, width = ring.shape
        if user_codes.dim() != 2 or user_codes.shape[0] != b or user_codes.shape[1] < cfg.user_q:
            raise ValueError(f"user_codes must be [{b}, >= {cfg.user_q}], got {list(user_codes.shape)}")
        delays = torch.tensor(cfg.delays, device=ring.device)  # [K]
        pos = state.kv.pos  # [B]
        user = user_codes[:, :cfg.user_q].to(ring.device, torch.long)
        at = (pos[:, None] + delays[cfg.dep_q + 1:]) % width  # [B, user_q]
        ring[:, cfg.dep_q + 1:].scatter_(2, at[..., None], user[..., None])
        current = ring.gather(2, (pos % width)[:, None, None].expand(b, k, 1))[..., 0]  # [B, K]
        initial = torch.tensor([cfg.text_card] + [cfg.card] * cfg.n_q, device=ring.device)
        inputs = torch.where(pos[:, None] <= delays, initial, current)
        h, text_logits = self.temporal(inputs, state.kv)
        text_logits = text_logits.float()
        text = text_logits.argmax(dim=-1) if sampler is None else sampler.text(text_logits, pos)
        audio = self.depth(text, h, sampler, pos)  # [B, dep_q]
        nxt = pos + 1
        made = torch.cat([text[:, None], audio], dim=1)  # [B, 1 + dep_q]
        ring[:, :cfg.dep_q + 1].scatter_(2, (nxt % width)[:, None, None].expand(b, cfg.dep_q + 1, 1), made[..., None])
        back = (nxt[:, None] - cfg.max_delay + delays[:cfg.dep_q + 1]) % width
        out = ring[:, :cfg.dep_q + 1].gather(2, back[..., None])[..., 0]
        ready = nxt > cfg.max_delay
        return StepOutput(torch.where(ready[:, None], out, UNGENERATED), ready)
