"""The reference Dual-AR loop for one or several requests (spec 8), and decoding to audio: the
engine's oracle. Per-request dense KV caches, the same model code and the same sampler as the
engine (seeded draws are keyed on (seed, stream, step), so they match the engine's exactly).

Per step: semantic token for every active request -> stop rows that drew <|im_end|> (their
frame is dropped) -> the fast AR's 10-pass inner loop over the remaining requests -> each new
frame is fed back into its request's slow AR.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from omnivox.errors import InputError
from omnivox.layers.attention import DenseKVCache
from omnivox.models.fish_s2.codec import FishCodec
from omnivox.models.fish_s2.fast_ar import FastAR, decode_frame
from omnivox.models.fish_s2.sampler import FishSamplingParams
from omnivox.models.fish_s2.slow_ar import SlowAR
from omnivox.sampling import noise
from omnivox.sampling.fish_rules import FishState, FishTensors, sample_residual, sample_semantic


@dataclass
class TTSRequest:
    prompt: torch.Tensor  # [1 + num_codebooks, T] from prompt.build_prompt
    params: FishSamplingParams = field(default_factory=FishSamplingParams)
    max_new_tokens: int = 1024  # frames; 0 = up to the context limit


@dataclass
class TTSResult:
    codes: torch.Tensor  # [num_codebooks, N] (the <|im_end|> frame is never included)
    stop: str  # "eos" | "length"


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
    seeds = [noise.draw_seed() if p.seed is None else p.seed for p in params]
    state = FishState.fresh(len(requests), dev)
    fast_cache = fast.new_cache()
    residual = residual_size or min(1024, cfg.codebook_size)
    while True:
        active = [i for i, lv in enumerate(lives) if not lv.stop]
        if not active:
            break
        idx = torch.tensor(active, device=dev)
        sub = state.select(idx)
        t = FishTensors.build([params[i] for i in active], [seeds[i] for i in active], dev)
        tokens = sample_semantic(torch.stack([lives[i].logits for i in active]), t, sub, cfg)
        going = []
        for row, (i, tok) in enumerate(zip(active, tokens.tolist())):
            if tok < 0:
                raise InputError("sampling failed: the logits hold no valid distribution")
            if tok == cfg.eos_id:
                lives[i].stop = "eos"
            else:
                going.append(row)
        if going:
            rows = torch.tensor(going, device=dev)
            c0 = (tokens[rows] - cfg.semantic_begin).clamp(0, cfg.codebook_size - 1)
            sub_t = FishTensors.build([params[active[j]] for j in going], [seeds[active[j]] for j in going], dev)
            steps = sub.steps[rows]
            frame = decode_frame(fast, torch.stack([lives[active[j]].hidden for j in going]), c0, fast_cache,
                                 lambda logits, p: sample_residual(logits, sub_t, steps, p, residual))
            for k, j in enumerate(going):
                _emit(slow, lives[active[j]], frame[k])
        state.assign(idx, sub)
    return [TTSResult(torch.stack(lv.frames, dim=1) if lv.frames else
                      torch.zeros(cfg.num_codebooks, 0, dtype=torch.long), lv.stop) for lv in lives]


def _prefill(slow: SlowAR, req: TTSRequest, dev) -> _Live:
    cfg = slow.cfg
    prompt = req.prompt.to(dev)
    if prompt.dim() != 2 or prompt.shape[0] != cfg.num_rows:
        raise InputError(f"prompt must be [{cfg.num_rows}, T], got {tuple(prompt.shape)}")
    t = prompt.shape[1]
    if t == 0 or t > cfg.max_prompt_len:
        raise InputError(f"prompt has {t} tokens; it must be 1..{cfg.max_prompt_len} "
                         f"(max_seq_len {cfg.text.max_seq_len} minus the output reserve)")
    live = _Live(DenseKVCache(), 0, torch.empty(0), torch.empty(0), cfg.frame_budget(t, req.max_new_tokens))
    _slow_step(slow, live, prompt[0], prompt[1:].T)
    return live


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
