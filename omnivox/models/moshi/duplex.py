"""The offline full-duplex API: `Duplex(model=DIR | "moshi-demo")`, `converse(pcm)` for one
session, `converse_many([pcm, ...])` for several batched: each session is a duplex session on the
engine (`MoshiServed.open_duplex`), its whole input pushed at once; the engine steps it one frame
per step as moshi's plain streaming loop does. A trailing partial frame is zero-padded to a whole
one. The reply has one frame per input frame but the LM's first max_delay (1 in the release),
which it never outputs.
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
from omnivox.engine.config import EngineConfig
from omnivox.errors import InputError
from omnivox.models.moshi.checkpoint import DEMO
from omnivox.models.moshi.served import MoshiServed
from omnivox.serving_duplex import DuplexParams


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
    threads while sessions run on a CPU (restored after); None: 1 for a model under 100M
    parameters, whose frames are many tiny ops (40x faster than 2 contended threads, measured on
    the demo), else torch's setting. `engine_config`: the engine's (None: the model's defaults)."""

    def __init__(self, model: str | Path = DEMO, dtype: str = "float32", device: str = "cpu",
                 cpu_threads: int | None = None, engine_config: EngineConfig | None = None):
        self.served = MoshiServed(model, dtype=dtype, device=device, engine_config=engine_config)
        small = self.served.parameter_count() < 100_000_000
        self.cpu_threads = cpu_threads if cpu_threads is not None else 1 if small else None
        self.cfg, self.tokenizer = self.served.cfg, self.served.tokenizer
        self.folder, self.is_demo = self.served.folder, self.served.is_demo
        self.sample_rate, self.frame_size = self.served.sample_rate, self.served.frame_size
        self.device = self.served.lm.device

    def close(self) -> None:
        self.served.close()

    def converse(self, pcm: np.ndarray | Sequence[float], sample_rate: int = 24000, **params) -> DuplexOutput:
        """One session; params as `converse_many`."""
        return self.converse_many([pcm], sample_rate=sample_rate, **params)[0]

    def converse_many(self, sessions: Sequence[np.ndarray], sample_rate: int = 24000, *, greedy: bool = False,
                      seed: int = 0, temp: float | None = None, temp_text: float | None = None,
                      top_k: int | None = None, top_k_text: int | None = None,
                      max_batch: int | None = None) -> list[DuplexOutput]:
        """Several sessions on the engine at once, each equal to its own `converse`: at most
        `max_batch` open at once (all by default), the next opened as one finishes. Sampling: the
        checkpoint's `lm_gen_config` (else moshi's LMGen defaults) unless given; `greedy` is
        argmax everywhere; every session draws from `seed` and its own frames."""
        frames = [self._frames(pcm, sample_rate, i) for i, pcm in enumerate(sessions)]
        if not frames:
            raise InputError("converse_many needs at least one session")
        seconds = max(f.size for f in frames) / self.sample_rate
        # DuplexParams checks the sampling values (the InputError names the field)
        params = DuplexParams(greedy=bool(greedy), seed=seed, temp=temp, temp_text=temp_text, top_k=top_k,
                              top_k_text=top_k_text, max_seconds=min(seconds, self.served.max_session_seconds))
        if seconds > self.served.max_session_seconds:
            raise InputError(f"a session of {seconds:.1f} s is over this model's limit of "
                             f"{self.served.max_session_seconds:.1f} s")
        limit = len(frames) if max_batch is None else max(1, int(max_batch))
        with self._threads():
            start = time.perf_counter()
            results = self._run(frames, params, limit)
            elapsed = time.perf_counter() - start
        return [DuplexOutput(tokens, audio, self.sample_rate, text, f.size // self.frame_size, elapsed)
                for f, (tokens, audio, text) in zip(frames, results)]

    def _run(self, frames: list[np.ndarray], params: DuplexParams, limit: int) -> list:
        """Open `limit` sessions, push each one's whole input and close it; collect them in order,
        opening the next as each is collected."""
        handles = []

        def open_next() -> None:
            handle, inp = self.served._open(params, None, None, playing=False)  # offline: batch work
            inp.push(frames[len(handles)])
            inp.close()
            handles.append(handle)

        for _ in range(min(limit, len(frames))):
            open_next()
        out = []
        for i in range(len(frames)):
            fin, audio = handles[i].collect()
            if len(handles) < len(frames):
                open_next()
            width = 1 + self.cfg.dep_q
            tokens = np.concatenate([np.asarray(fin.text_ids, np.int64).reshape(-1, 1), fin.codes], axis=1) \
                if fin.text_ids else np.zeros((0, width), np.int64)
            out.append((tokens, audio, fin.text))
        return out

    @contextlib.contextmanager
    def _threads(self):
        before = torch.get_num_threads()
        if self.device.type == "cpu" and self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _frames(self, pcm, sample_rate: int, index: int) -> np.ndarray:
        """[N] samples at `sample_rate` -> [frames * 1920] at 24 kHz (the last frame zero-padded)."""
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
        return padded
