"""The offline full-duplex API: `Duplex(model=DIR | "moshi-demo")`, `converse(pcm)` for one
session, `converse_many([pcm, ...])` for several batched in one frame loop (`DuplexStepper`).

A session is the user's whole input audio, fed one 1920-sample frame per step as moshi's plain
streaming loop does; a trailing partial frame is zero-padded to a whole one. The reply has one
frame per input frame but the LM's first max_delay (1 in the release), which it never outputs.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from omnivox.audio.io import resample
from omnivox.errors import InputError
from omnivox.models.moshi.checkpoint import DEMO, load_moshi
from omnivox.models.moshi.lm_sampling import MoshiSampler, MoshiSamplingParams
from omnivox.models.moshi.stepper import DuplexState, DuplexStepper


@dataclass
class DuplexOutput:
    tokens: np.ndarray  # [frames, 1 + dep_q] int64: per output frame the text token, then the model's audio codes
    audio: np.ndarray  # [frames * 1920] float32: Mimi's frame-by-frame decode of tokens[:, 1:]
    sample_rate: int
    text: str  # the text tokens' pieces joined (padding tokens add nothing)
    input_frames: int  # 1920-sample frames of input (after resampling and padding)
    seconds: float  # wall time of the frame loop (shared by the sessions of one converse_many)

    @property
    def frames(self) -> int:
        return int(self.tokens.shape[0])


class Duplex:
    """Moshi offline. dtype: the LM's weights (Mimi runs in fp32). cpu_threads: torch's intra-op
    threads while a CPU frame loop runs (restored after); None: 1 for a model under 100M
    parameters, whose frames are many tiny ops (40x faster than 2 contended threads, measured on
    the demo), else torch's setting."""

    def __init__(self, model: str | Path = DEMO, dtype: str = "float32", device: str = "cpu",
                 cpu_threads: int | None = None):
        ckpt = load_moshi(model, dtype=dtype, device=device)
        small = sum(p.numel() for m in (ckpt.lm, ckpt.mimi) for p in m.parameters()) < 100_000_000
        self.cpu_threads = cpu_threads if cpu_threads is not None else 1 if small else None
        self.cfg, self.tokenizer, self.folder, self.is_demo = ckpt.cfg, ckpt.tokenizer, ckpt.folder, ckpt.is_demo
        self.stepper = DuplexStepper(ckpt.lm, ckpt.mimi)
        self.sample_rate = ckpt.mimi.cfg.sample_rate
        self.frame_size = self.stepper.frame_size

    def converse(self, pcm: np.ndarray | Sequence[float], sample_rate: int = 24000, **params) -> DuplexOutput:
        """One session; params as `converse_many`."""
        return self.converse_many([pcm], sample_rate=sample_rate, **params)[0]

    def converse_many(self, sessions: Sequence[np.ndarray], sample_rate: int = 24000, *, greedy: bool = False,
                      seed: int = 0, temp: float | None = None, temp_text: float | None = None,
                      top_k: int | None = None, top_k_text: int | None = None,
                      max_batch: int | None = None) -> list[DuplexOutput]:
        """Several sessions in one frame loop, each equal to its own `converse`: rows join as a
        place frees (at most `max_batch` at once, all by default) and leave when their audio ends.
        Sampling: the checkpoint's `lm_gen_config` (else moshi's LMGen defaults) unless given;
        `greedy` is argmax everywhere; every session draws from `seed` and its own frames."""
        frames = [self._frames(pcm, sample_rate, i) for i, pcm in enumerate(sessions)]
        if not frames:
            raise InputError("converse_many needs at least one session")
        params = self._params(greedy, temp, temp_text, top_k, top_k_text)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise InputError(f"seed must be a non-negative int, got {seed!r}")
        limit = len(frames) if max_batch is None else max(1, int(max_batch))
        with self._threads():
            start = time.perf_counter()
            tokens, audio = _Loop(self.stepper, frames, params, seed, limit).run()
            seconds = time.perf_counter() - start
        return [DuplexOutput(t, a, self.sample_rate, self.tokenizer.text(t[:, 0].tolist()), len(f), seconds)
                for f, t, a in zip(frames, tokens, audio)]

    @contextlib.contextmanager
    def _threads(self):
        before = torch.get_num_threads()
        if self.stepper.device.type == "cpu" and self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _frames(self, pcm, sample_rate: int, index: int) -> torch.Tensor:
        """[N] samples at `sample_rate` -> [frames, 1920] at 24 kHz (the last frame zero-padded)."""
        x = np.asarray(pcm, dtype=np.float32)
        what = "input audio" if index == 0 else f"session {index}'s audio"
        if x.ndim != 1:
            raise InputError(f"{what} must be 1-D mono samples, got shape {list(x.shape)}")
        if x.size == 0:
            raise InputError(f"{what} is empty: a session needs at least one sample")
        if not np.isfinite(x).all():
            raise InputError(f"{what} contains NaN or infinite samples")
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate <= 0:
            raise InputError(f"sample_rate must be a positive int, got {sample_rate!r}")
        if sample_rate != self.sample_rate:
            x = resample(x, sample_rate, self.sample_rate)
        n = -(-x.size // self.frame_size)
        padded = np.zeros(n * self.frame_size, dtype=np.float32)
        padded[:x.size] = x
        return torch.from_numpy(padded).view(n, self.frame_size)

    def _params(self, greedy, temp, temp_text, top_k, top_k_text) -> MoshiSamplingParams:
        base = self.cfg.gen
        given = dict(temp=temp, temp_text=temp_text, top_k=top_k, top_k_text=top_k_text)
        for name, v in given.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
                raise InputError(f"{name} must be a non-negative number, got {v!r}")
        return MoshiSamplingParams(use_sampling=not greedy, **{
            k: type(getattr(base, k))(v) if v is not None else getattr(base, k) for k, v in given.items()})


class _Loop:
    """The frame loop of converse_many: a running batch of rows (sessions), joined and left between steps."""

    def __init__(self, stepper: DuplexStepper, frames: list[torch.Tensor], params: MoshiSamplingParams, seed: int,
                 limit: int):
        self.stepper, self.frames, self.params, self.seed, self.limit = stepper, frames, params, seed, limit
        self.tokens: list[list[np.ndarray]] = [[] for _ in frames]
        self.audio: list[list[np.ndarray]] = [[] for _ in frames]

    def run(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        waiting = list(range(len(self.frames)))
        rows: list[int] = []  # the session of each row
        state: DuplexState | None = None
        step: list[int] = []  # each row's next input frame
        sampler, sampler_rows = None, 0
        while waiting or rows:
            joining = waiting[:self.limit - len(rows)]
            if joining:
                del waiting[:len(joining)]
                fresh = self.stepper.init_state(len(joining))
                state = fresh if state is None else DuplexState.concat([state, fresh])
                rows, step = rows + joining, step + [0] * len(joining)
            if sampler is None or sampler_rows != len(rows):  # one per batch (rows share params and seed)
                sampler, sampler_rows = self._sampler(len(rows)), len(rows)
            pcm = torch.stack([self.frames[s][t] for s, t in zip(rows, step)])
            out = self.stepper.step(state, pcm, sampler if self.params.use_sampling else None)
            ready = out.ready.tolist()
            tokens, audio = out.tokens.cpu().numpy(), out.audio.float().cpu().numpy()
            for i, s in enumerate(rows):
                if ready[i]:
                    self.tokens[s].append(tokens[i])
                    self.audio[s].append(audio[i])
            step = [t + 1 for t in step]
            keep = [i for i, (s, t) in enumerate(zip(rows, step)) if t < len(self.frames[s])]
            if len(keep) < len(rows):
                rows, step = [rows[i] for i in keep], [step[i] for i in keep]
                state = state.select(keep) if keep else None
        width = 1 + self.stepper.lm.cfg.dep_q
        return self._collect(width)

    def _sampler(self, rows: int) -> MoshiSampler:
        return MoshiSampler.build([self.params] * rows, [self.seed] * rows, self.stepper.device)

    def _collect(self, width: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        return ([np.stack(t).astype(np.int64) if t else np.zeros((0, width), np.int64) for t in self.tokens],
                [np.concatenate(a) if a else np.zeros(0, np.float32) for a in self.audio])
