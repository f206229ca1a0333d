"""A simple offline Dual-AR loop for one or several requests (spec 8), and decoding to audio.

Per step: semantic token for every active request (batched sampling) -> stop rows that drew
<|im_end|> (their frame is dropped) -> the fast AR's 10-pass inner loop batched across the
remaining requests -> each request's new frame is fed back into its slow AR (per-request dense
KV cache here; the engine's paged cache batches this step too).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from omnivox.errors import InputError
from omnivox.layers.attention import DenseKVCache
from omnivox.models.fish_s2.codec import FishCodec
from omnivox.models.fish_s2.config import FishConfig
from omnivox.models.fish_s2.fast_ar import FastAR, decode_frame
from omnivox.models.fish_s2.sampler import (FishSamplingParams, SemanticState, make_generator, sample_residual,
                                            sample_semantic)
from omnivox.models.fish_s2.slow_ar import SlowAR

OUTPUT_RESERVE = 2048


@dataclass
class TTSRequest:
    prompt: torch.Tensor  # [1 + num_codebooks, T] from prompt.build_prompt
    params: FishSamplingParams = field(default_factory=FishSamplingParams)
    max_new_tokens: int = 1024  # frames; 0 = up to the context limit


@dataclass
class TTSResult:
    codes: torch.Tensor  # [num_codebooks, N] (the <|im_end|> frame is never included)
    stop: str  # "eos" | "length"


def max_prompt_len(cfg: FishConfig) -> int:
    """fish-speech refuses prompts longer than max_seq_len - 2048 (halved reserve for tiny configs)."""
    return cfg.text.max_seq_len - min(OUTPUT_RESERVE, cfg.text.max_seq_len // 2)


def frame_budget(cfg: FishConfig, prompt_len: int, max_new_tokens: int) -> int:
    room = cfg.text.max_seq_len - prompt_len
    return room if max_new_tokens <= 0 else min(max_new_tokens, room)


@dataclass
class _Live:
    """One request's slow-AR state during the loop."""

    cache: DenseKVCache
    length: int  # positions in the cache
    logits: torch.Tensor  # [V] at the last position
    hidden: torch.Tensor  # [dim] fast-AR input at the last position
    budget: int
    frames: list[torch.Tensor] = field(default_factory=list)
    stop: str = ""


def _slow_step(slow: SlowAR, live: _Live, ids: torch.Tensor, codes: torch.Tensor) -> None:
    """Feed S new columns (ids [S], codes [S, N]) of one request through its cache."""
    pos = torch.arange(live.length, live.length + ids.numel(), device=ids.device)[None]
    out = slow(ids[None], codes[None], pos, live.cache)
    live.length += ids.numel()
    live.logits = slow.logits(out.hidden[0, -1])
    live.hidden = slow.fast_input(out)[0, -1]


@torch.no_grad()
def generate(slow: SlowAR, fast: FastAR, requests: Sequence[TTSRequest],
             residual_size: int | None = None) -> list[TTSResult]:
    """Run every request to <|im_end|> or its frame budget; codes per request [N_cb, frames].

    residual_size: the codec's residual codebook size (1024), used only by requests that set
    `mask_residual_overflow`; defaults to min(1024, codebook_size).
    """
    cfg = slow.cfg
    dev = slow.norm.weight.device
    lives = [_prefill(slow, r, dev) for r in requests]
    params = [r.params for r in requests]
    gens = [make_generator(p.seed, dev) for p in params]
    state = SemanticState.fresh(len(requests), params[0].ras_window if params else 10,
                                params[0].penalty_window if params else 16, dev)
    fast_cache = fast.new_cache()
    residual = residual_size or min(1024, cfg.codebook_size)
    while True:
        active = [i for i, lv in enumerate(lives) if not lv.stop]
        if not active:
            break
        tokens = _sample_rows(lives, active, params, gens, state, cfg)
        going = []
        for i, t in zip(active, tokens.tolist()):
            if t == cfg.eos_id:
                lives[i].stop = "eos"
            else:
                going.append(i)
        if not going:
            continue
        h = torch.stack([lives[i].hidden for i in going])  # [B, dim]
        c0 = (tokens[[active.index(i) for i in going]] - cfg.semantic_begin).clamp(0, cfg.codebook_size - 1)
        sub_params, sub_gens = [params[i] for i in going], [gens[i] for i in going]
        frame = decode_frame(fast, h, c0, fast_cache,
                             lambda logits, p: sample_residual(logits, sub_params, sub_gens, residual))
        for row, i in enumerate(going):
            _emit(slow, lives[i], frame[row])
    return [TTSResult(torch.stack(lv.frames, dim=1) if lv.frames else
                      torch.zeros(cfg.num_codebooks, 0, dtype=torch.long), lv.stop) for lv in lives]


def _prefill(slow: SlowAR, req: TTSRequest, dev) -> _Live:
    cfg = slow.cfg
    prompt = req.prompt.to(dev)
    if prompt.dim() != 2 or prompt.shape[0] != cfg.num_rows:
        raise InputError(f"prompt must be [{cfg.num_rows}, T], got {tuple(prompt.shape)}")
    t = prompt.shape[1]
    if t == 0 or t > max_prompt_len(cfg):
        raise InputError(f"prompt has {t} tokens; it must be 1..{max_prompt_len(cfg)} "
                         f"(max_seq_len {cfg.text.max_seq_len} minus the output reserve)")
    live = _Live(DenseKVCache(), 0, torch.empty(0), torch.empty(0), frame_budget(cfg, t, req.max_new_tokens))
    _slow_step(slow, live, prompt[0], prompt[1:].T)
    return live


def _sample_rows(lives, active, params, gens, state, cfg) -> torch.Tensor:
    logits = torch.stack([lives[i].logits for i in active])
    idx = torch.tensor(active, device=logits.device)
    sub = state.select(idx)
    tokens = sample_semantic(logits, [params[i] for i in active], sub, [gens[i] for i in active], cfg)
    state.window[idx], state.history[idx], state.steps[idx] = sub.window, sub.history, sub.steps
    return tokens


def _emit(slow: SlowAR, live: _Live, frame: torch.Tensor) -> None:
    """Keep the frame [N] and feed it back, unless the budget is spent."""
    cfg = slow.cfg
    live.frames.append(frame)
    if len(live.frames) >= live.budget:
        live.stop = "length"
        return
    token = (frame[:1] + cfg.semantic_begin)
    _slow_step(slow, live, token, frame[None])


@torch.no_grad()
def codes_to_audio(codec: FishCodec, codes: torch.Tensor) -> torch.Tensor:
    """codes [N_cb, N] -> mono waveform [hop * N] at codec.cfg.sample_rate."""
    dev = next(codec.parameters()).device
    return codec.decode(codes[None].to(dev))[0, 0]


@torch.no_grad()
def encode_reference(codec: FishCodec, source) -> torch.Tensor:
    """Reference audio (path or bytes, any rate) -> codes [N_cb, ceil(L / hop)] at 44.1 kHz."""
    from omnivox.audio.io import load_audio

    wav = torch.from_numpy(load_audio(source, target_sr=codec.cfg.sample_rate))
    p = next(codec.parameters())
    return codec.encode(wav.to(p.device, p.dtype)[None, None])[0]
