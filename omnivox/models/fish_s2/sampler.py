"""Sampling for S2 (spec 10): fish-speech behaviour by default, SGLang-Omni 0.1.9 selectable.

fish ("fish"): constrained logits -> top-p (drop the crossing token) / top-k on UNTEMPERED
logits -> divide by temperature -> softmax -> exponential-race draw. RAS: on decode steps draw a
second candidate at temperature 1.0 / top-p 0.9 and take it when the normal draw is a semantic
token already in the last-10 window (zeros at start; the prefill token is never inserted).
Residual codes c1.. are sampled with the same parameters over all K logits.

sglang ("sglang"): constrained logits rounded to bf16 -> RAS when the last 4 tokens hold a
duplicate -> repetition penalty over 16 tokens -> top-k (<= 30) -> top-p -> temperature ->
Gumbel draw seeded by (seed, step). Residual codes are greedy.

Every draw of row b uses only row b's generator, so a seeded request samples the same tokens
alone or batched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from omnivox.errors import InputError
from omnivox.layers.streaming_conv import BatchedState
from omnivox.models.fish_s2.config import FishConfig

MODES = ("fish", "sglang")
SGL_TOPK_WIDTH = 30


@dataclass(frozen=True)
class FishSamplingParams:
    temperature: float = 0.8
    top_p: float = 0.8
    top_k: int = 30
    mode: str = "fish"
    seed: int | None = None
    ras_window: int = 10  # fish: last-N window
    ras_temperature: float = 1.0
    ras_top_p: float = 0.9
    sgl_ras_window: int = 4  # sglang: duplicate among the last N
    repetition_penalty: float = 1.1  # sglang only (fish accepts and ignores it)
    penalty_window: int = 16
    greedy_residual: bool | None = None  # None: fish samples, sglang argmax
    mask_residual_overflow: bool = False  # opt-in deviation: forbid residual codes >= codec size

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"sampling mode must be one of {MODES}, got {self.mode!r}")
        if not (0.0 <= self.temperature <= 100):
            raise InputError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise InputError(f"top_k must be a non-negative integer (0 = off), got {self.top_k}")
        if self.mode == "sglang" and self.top_k > SGL_TOPK_WIDTH:
            raise InputError(f"sglang mode supports top_k <= {SGL_TOPK_WIDTH}, got {self.top_k}")

    @property
    def residual_is_greedy(self) -> bool:
        return self.mode == "sglang" if self.greedy_residual is None else self.greedy_residual


def make_generator(seed: int | None, device="cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def semantic_bias(cfg: FishConfig, vocab: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """[V]: 0 for the semantic ids and <|im_end|>, -inf elsewhere (constrained decoding)."""
    bias = torch.full((vocab,), float("-inf"), device=device, dtype=dtype)
    bias[cfg.semantic_begin: cfg.semantic_end + 1] = 0
    bias[cfg.eos_id] = 0
    return bias


def filter_top_p_top_k(logits: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """fish-speech rule on [B, V] logits: remove ranks whose cumulative probability (untempered)
    exceeds top_p (the crossing token too) and ranks >= top_k (0 = off); rank 0 always stays."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    rank = torch.arange(logits.shape[-1], device=logits.device)
    remove = cum > top_p[:, None]
    remove |= (top_k[:, None] > 0) & (rank[None] >= top_k[:, None])
    remove[:, 0] = False
    mask = torch.zeros_like(remove).scatter(-1, order, remove)
    return logits.masked_fill(mask, float("-inf"))


def exponential_race(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Exact categorical draw per row: argmax p / q with q ~ Exp(1) from that row's generator."""
    q = torch.stack([torch.empty(probs.shape[-1], dtype=probs.dtype, device=probs.device).exponential_(
        1.0, generator=g) for g in generators])
    return (probs / q).argmax(dim=-1)


def fish_draw(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
              generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Filter, then temper, then draw: logits [B, V] -> ids [B]."""
    kept = filter_top_p_top_k(logits.float(), top_p, top_k)
    probs = (kept / temperature.clamp(min=1e-5)[:, None]).softmax(dim=-1)
    return exponential_race(probs, generators)


@dataclass
class SemanticState(BatchedState):
    """Per-request sampler memory (batch-first, so engines can select / concat rows)."""

    window: torch.Tensor  # [B, ras_window] long: fish RAS window, zeros at start
    history: torch.Tensor  # [B, penalty_window] long: sglang recent tokens, -1 = empty
    steps: torch.Tensor  # [B] long: tokens sampled so far (0 = the prefill step)

    @classmethod
    def fresh(cls, batch: int, ras_window: int = 10, penalty_window: int = 16, device=None) -> "SemanticState":
        return cls(torch.zeros(batch, ras_window, dtype=torch.long, device=device),
                   torch.full((batch, penalty_window), -1, dtype=torch.long, device=device),
                   torch.zeros(batch, dtype=torch.long, device=device))


def _col(params: Sequence[FishSamplingParams], name: str, device) -> torch.Tensor:
    return torch.tensor([float(getattr(p, name)) for p in params], device=device)


def _push(ring: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Shift `tokens` into the end of ring rows where rows is True."""
    shifted = torch.cat((ring[:, 1:], tokens[:, None]), dim=1)
    return torch.where(rows[:, None], shifted, ring)


def sample_semantic(logits: torch.Tensor, params: Sequence[FishSamplingParams], state: SemanticState,
                    generators: Sequence[torch.Generator], cfg: FishConfig) -> torch.Tensor:
    """logits [B, V] of the slow AR's last position -> token ids [B]; updates `state` in place."""
    biased = logits.float() + semantic_bias(cfg, logits.shape[-1], logits.device)
    modes = {p.mode for p in params}
    if len(modes) > 1:
        raise InputError("one sample_semantic call takes rows of a single sampling mode")
    if modes == {"fish"}:
        tokens = _sample_fish(biased, params, state, generators, cfg)
    else:
        tokens = _sample_sglang(biased, params, state, generators, cfg)
    state.history = _push(state.history, tokens, torch.ones_like(tokens, dtype=torch.bool))
    state.steps = state.steps + 1
    return tokens


def _sample_fish(biased, params, state, generators, cfg) -> torch.Tensor:
    dev = biased.device
    tokens = fish_draw(biased, _col(params, "temperature", dev), _col(params, "top_p", dev),
                       _col(params, "top_k", dev).long(), generators)
    decode = state.steps > 0  # [B]; the prefill step has no RAS and is not windowed
    if bool(decode.any()):
        rows = decode.nonzero().flatten().tolist()
        sub = [params[i] for i in rows]
        fallback = fish_draw(biased[rows], _col(sub, "ras_temperature", dev), _col(sub, "ras_top_p", dev),
                             _col(sub, "top_k", dev).long(), [generators[i] for i in rows])
        normal = tokens[rows]
        semantic = (normal >= cfg.semantic_begin) & (normal <= cfg.semantic_end)
        repeated = (state.window[rows] == normal[:, None]).any(dim=1)
        tokens = tokens.clone()
        tokens[rows] = torch.where(semantic & repeated, fallback, normal)
    state.window = _push(state.window, tokens, decode)
    return tokens


def _sample_sglang(biased, params, state, generators, cfg) -> torch.Tensor:
    dev = biased.device
    x = biased.to(torch.bfloat16).float()
    temperature, top_p = _col(params, "temperature", dev), _col(params, "top_p", dev)
    window = state.history[:, -params[0].sgl_ras_window:]
    valid = window >= 0
    dup = ((window[:, :, None] == window[:, None, :]) & valid[:, :, None] & valid[:, None, :]).sum((1, 2)) > valid.sum(1)
    ras = dup & (state.steps >= params[0].sgl_ras_window)
    temperature = torch.where(ras, _col(params, "ras_temperature", dev), temperature)
    top_p = torch.where(ras, _col(params, "ras_top_p", dev), top_p)
    x = apply_repetition_penalty(x, state.history[:, -params[0].penalty_window:], _col(params, "repetition_penalty", dev))
    width = min(SGL_TOPK_WIDTH, x.shape[-1])
    top_k = _col(params, "top_k", dev).long()
    top_k = torch.where(top_k > 0, top_k, torch.full_like(top_k, width)).clamp(max=width)
    kept = filter_top_p_top_k(x, top_p, top_k)
    scores = kept / temperature.clamp(min=1e-5)[:, None]
    gumbel = torch.stack([_step_gumbel(p, int(s), generators[i], x.shape[-1], dev)
                          for i, (p, s) in enumerate(zip(params, state.steps.tolist()))])
    return (scores + gumbel).argmax(dim=-1)


def _step_gumbel(p: FishSamplingParams, step: int, gen: torch.Generator, n: int, device) -> torch.Tensor:
    """Gumbel noise keyed on (seed, step) when the request has a seed, else from its generator."""
    if p.seed is not None:
        gen = torch.Generator(device=device).manual_seed((p.seed * 1_000_003 + step) % (2 ** 63))
    u = torch.rand(n, generator=gen, device=device).clamp(min=1e-20)
    return -torch.log(-torch.log(u))


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Penalise tokens in history ([B, H], -1 = empty): positive logits / p, negative * p."""
    valid = history >= 0
    idx = history.clamp(min=0)
    picked = logits.gather(1, idx)
    p = penalty[:, None]
    new = torch.where(picked > 0, picked / p, picked * p)
    new = torch.where(valid, new, picked)
    return logits.scatter(1, idx, new)


def sample_residual(logits: torch.Tensor, params: Sequence[FishSamplingParams],
                    generators: Sequence[torch.Generator], residual_size: int) -> torch.Tensor:
    """Fast-AR logits [B, K] for one residual codebook -> codes [B] (greedy or fish draw per row)."""
    x = logits.float()
    overflow = torch.tensor([p.mask_residual_overflow for p in params], device=x.device)
    if bool(overflow.any()):
        cols = torch.arange(x.shape[-1], device=x.device) >= residual_size
        x = x.masked_fill(overflow[:, None] & cols[None], float("-inf"))
    greedy = torch.tensor([p.residual_is_greedy for p in params], device=x.device)
    out = x.argmax(dim=-1)
    if not bool(greedy.all()):
        rows = (~greedy).nonzero().flatten().tolist()
        sub = [params[i] for i in rows]
        dev = x.device
        out[rows] = fish_draw(x[rows], _col(sub, "temperature", dev), _col(sub, "top_p", dev),
                              _col(sub, "top_k", dev).long(), [generators[i] for i in rows])
    return out
