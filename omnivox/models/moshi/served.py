"""Moshi served: the full-duplex serving protocol (`omnivox.serving_duplex.DuplexModel`) over a
loaded checkpoint. A session is one engine request (`stages/graph.py`): `open_duplex` returns its
handle and its input; the caller pushes the user's PCM, the engine steps the session one frame
per step as whole frames arrive, and the handle yields per output frame a `TextDelta` (unless the
text token is padding) and an `AudioChunk` of one frame, due (`AudioChunk.due`) one frame after
the input frame whose step made it arrived.

Sessions and their KV: the LM's KV is paged under a sliding window of `context` frames, and the
scheduler gives back each session's pages wholly behind the window (`ARScheduler.slide`), so a
session holds at most `session_pages` = `window_pages(context, token_budget, block_size)` pages
whatever its length (the chunk is the token budget: a preempted session recomputes in chunks).
`max_sessions`: the sessions the pool holds at once (at most `max_running`); `open_duplex` refuses
one more (Overloaded), since a live session that waits for pages, or is preempted to make room,
falls behind its user. The default KV budget holds `max_running` sessions (at most 4096 MB).
A session's length is bounded by `MAX_SESSION_SECONDS` (not by the KV): what grows with it is
its host-side history (the user's codes and the LM's tokens, about 140 bytes a frame, kept so a
preempted session can recompute) and its collected output.
"""
from __future__ import annotations

import math
import threading
from dataclasses import replace
from typing import Callable
from pathlib import Path

import numpy as np

from omnivox.engine.config import EngineConfig
from omnivox.engine.owner import EngineOwner
from omnivox.engine.handle import RequestHandle
from omnivox.engine.placement import Placement
from omnivox.engine.scheduler import window_pages
from omnivox.engine.prompt import AudioPiece, PromptStream, Segment
from omnivox.errors import InputError
from omnivox.kv_cache.pool import KVPool
from omnivox.models.moshi.checkpoint import DEMO, load_moshi
from omnivox.models.moshi.family import FAMILY
from omnivox.models.moshi.lm_sampling import MoshiSamplingParams
from omnivox.models.moshi.stages.graph import SessionOptions, kv_blocks, served_graph
from omnivox.models.moshi.stages.request import DuplexRequest
from omnivox.media_budget import MediaLimits
from omnivox.sampling import noise
from omnivox.serving import SpeechParams, stage_weight_bytes
from omnivox.serving_duplex import DuplexParams

MAX_SESSION_SECONDS = 3600.0  # the longest session (see the module docstring)


class SessionInput:
    """`DuplexInput`: the user's PCM cut into whole frames, one stream segment per frame, each
    stamped with its arrival on the engine clock as it is sent (`DuplexRequest.arrivals`: its
    output frame's `AudioChunk.due`). `options`: the model's checks of a session's params
    (`MoshiServed._options`)."""

    def __init__(self, req: DuplexRequest, frame_size: int, options: Callable[[DuplexParams], SessionOptions]):
        self.req, self.frame_size, self.options = req, frame_size, options
        self.stream, self.user = req.stream, req.user
        self._lock = threading.Lock()
        self._tail = np.zeros(0, np.float32)
        self._frames = 0
        self._closed = False

    def push(self, pcm: np.ndarray) -> None:
        x = np.asarray(pcm, dtype=np.float32)
        if x.ndim != 1:
            raise InputError(f"duplex audio must be 1-D mono samples, got shape {list(x.shape)}")
        if not np.isfinite(x).all():
            raise InputError("duplex audio contains NaN or infinite samples")
        with self._lock:
            if self._closed:
                raise InputError("the session's input is closed")
            buf = np.concatenate([self._tail, x])
            n = buf.size // self.frame_size
            self._send(buf[:n * self.frame_size])
            self._tail = buf[n * self.frame_size:]

    def update(self, params: DuplexParams) -> None:
        if isinstance(params, DuplexParams) and params.max_seconds is not None:
            raise InputError("max_seconds is fixed when a session opens", param="max_seconds")
        opts = self.options(params)
        # the LM stage reads both per step (one attribute each: no torn read); the seed stays unless given
        self.req.params = opts.params
        if params.seed is not None:
            self.req.seed = opts.seed

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._tail.size:
                last = np.zeros(self.frame_size, np.float32)
                last[:self._tail.size] = self._tail
                self._tail = self._tail[:0]
                try:
                    self._send(last)
                except InputError:
                    pass  # the session ended already (its maximum length)
            self.stream.close()

    def _send(self, pcm: np.ndarray) -> None:
        frames = pcm.reshape(-1, self.frame_size)
        if not len(frames):
            return
        segs = [Segment([0], audio=AudioPiece(frames[i:i + 1].copy(), self.user, self._frames + i))
                for i in range(len(frames))]
        arrivals = self.req.arrivals  # stamped before the engine can see the frames (their outputs' `due`)
        arrivals.extend([self.req.clock.now()] * len(frames))
        try:
            self.stream.extend(segs)
        except ValueError:
            del arrivals[self._frames:]
            raise InputError("the session has ended (its maximum length); no more audio is taken") from None
        self._frames += len(frames)


class MoshiServed(EngineOwner):
    """A Moshi checkpoint as a `DuplexModel`. dtype: the LM's weights (Mimi runs in fp32)."""

    family = FAMILY
    modalities = ["text", "audio"]
    builtin_voices: list[str] = []
    default_voice = None

    def __init__(self, model: str | Path | None = None, dtype: str = "float32", device: str = "cpu",
                 progress: bool = True, engine_config: EngineConfig | None = None, placement=None,
                 quantization: str | None = None, fp8_compute: str = "auto"):
        if quantization is not None:
            raise InputError("quantization is not supported for Moshi yet")
        where = Placement.parse(placement, device).check(FAMILY.stages)
        if len({where.device(s) for s in FAMILY.stages}) > 1:
            raise InputError("Moshi runs on one device: its stages share Mimi (drop the placement)")
        device = str(where.device("lm"))
        ckpt = load_moshi(DEMO if model is None else model, dtype=dtype, device=device)
        self.cfg, self.lm, self.mimi, self.tokenizer = ckpt.cfg, ckpt.lm, ckpt.mimi, ckpt.tokenizer
        self.folder, self.is_demo = ckpt.folder, ckpt.is_demo
        cfg = engine_config or EngineConfig()
        if cfg.speculative is not None:
            raise InputError("speculative decoding drafts a Thinker's text; Moshi has none (drop the speculative config)")
        # one frame per audio chunk, as it is made; no CUDA graphs yet (the depformer's sampling is eager)
        self.engine_config = replace(cfg, vocoder_chunk_frames=1, first_chunk_frames=1, cuda_graphs="off")
        if engine_config is None:
            self.engine_config = replace(self.engine_config, kv_cache_mb=self.default_kv_mb())
        self.media_limits = MediaLimits()
        self.kv_budget = None

    # ---- facts ----------------------------------------------------------------------------
    def build_graph(self):
        return served_graph(self, self.engine_config)

    @property
    def sample_rate(self) -> int:
        return self.mimi.cfg.sample_rate

    @property
    def frame_size(self) -> int:
        return self.mimi.frame_size

    @property
    def frame_rate(self) -> float:
        return self.sample_rate / self.frame_size

    @property
    def max_session_frames(self) -> int:
        """Frames one session may take (`MAX_SESSION_SECONDS`)."""
        return math.ceil(MAX_SESSION_SECONDS * self.frame_rate)

    @property
    def max_session_seconds(self) -> float:
        return self.max_session_frames / self.frame_rate

    @property
    def session_pages(self) -> int:
        """The most LM pages one session holds at once (its window's bound; see the module docstring)."""
        cfg = self.engine_config
        return min(window_pages(self.cfg.transformer.context, cfg.token_budget, cfg.block_size),
                   -(-self.max_session_frames // cfg.block_size))

    @property
    def default_params(self) -> DuplexParams:
        """The checkpoint's sampling (`lm_gen_config`, else moshi's LMGen defaults)."""
        g = self.cfg.gen
        return DuplexParams(temp=g.temp, temp_text=g.temp_text, top_k=g.top_k, top_k_text=g.top_k_text)

    @property
    def max_sessions(self) -> int:
        """Sessions at once: as many as the LM's pages hold, at most max_running."""
        return min(self.engine_config.max_running, kv_blocks(self.lm, self.engine_config) // self.session_pages)

    @property
    def max_model_len(self) -> int:
        return self.max_session_frames

    @property
    def audio_context_frames(self) -> int:
        return self.max_session_frames

    @property
    def default_max_frames(self) -> int:
        return self.max_session_frames

    def parameter_count(self) -> int:
        return sum(p.numel() for m in (self.lm, self.mimi) for p in m.parameters())

    def weight_bytes(self) -> dict[str, dict[str, int]]:
        return stage_weight_bytes({"lm": [self.lm], "vocoder": [self.mimi]})

    def default_kv_mb(self) -> float:
        """Pages for max_running sessions (`session_pages` each), at most 4096 MB."""
        t, cfg = self.cfg.transformer, self.engine_config
        per_page = KVPool.bytes_per_block(t.num_layers, cfg.block_size, t.kv_heads, t.head_dim, self.lm.dtype)
        return min(4096.0, math.ceil(cfg.max_running * self.session_pages * per_page / 2**20))

    def kv_summary(self) -> str:
        cfg = self.engine_config
        pages = kv_blocks(self.lm, cfg)
        return (f"LM {pages} pages of {cfg.block_size} frames ({cfg.kv_cache_mb:g} MB); {self.session_pages} pages "
                f"per session (window {self.cfg.transformer.context} frames): {self.max_sessions} sessions at once")

    def describe(self) -> list[str]:
        return [f"Moshi (full duplex, {self.sample_rate} Hz, {self.frame_rate:g} frames/s); "
                f"{self.max_sessions} sessions at once, each up to {self.max_session_seconds:.0f} s"]

    def bench_workload(self, args):
        raise InputError("`omnivox bench` does not drive duplex sessions; use benchmarks/duplex_step.py")

    # ---- text to speech: refused ------------------------------------------------------------
    def check_speech(self, params: SpeechParams) -> None:
        raise InputError("Moshi is full duplex: it does not speak given text (open a duplex session instead)")

    def speech(self, text: str, params: SpeechParams = SpeechParams(), **kwargs) -> RequestHandle:
        self.check_speech(params)

    # ---- duplex -----------------------------------------------------------------------------
    def check_duplex(self, params: DuplexParams) -> None:
        self._options(params)

    def _options(self, params: DuplexParams) -> SessionOptions:
        if not isinstance(params, DuplexParams):
            raise InputError(f"duplex params must be DuplexParams, got {type(params).__name__}")
        base = self.cfg.gen
        knobs = {k: getattr(params, k) for k in ("temp", "temp_text", "top_k", "top_k_text")}
        sampling = MoshiSamplingParams(use_sampling=not params.greedy, **{
            k: type(getattr(base, k))(v) if v is not None else getattr(base, k) for k, v in knobs.items()})
        limit = self.max_session_frames
        frames = limit
        if params.max_seconds is not None:
            frames = math.ceil(params.max_seconds * self.frame_rate - 1e-9)
            if frames > limit:
                raise InputError(f"max_seconds {params.max_seconds:g} is over this model's session limit of "
                                 f"{self.max_session_seconds:.1f} s", param="max_seconds")
        seed = noise.draw_seed() if params.seed is None else params.seed
        return SessionOptions(sampling, seed, max(1, frames))

    def open_duplex(self, params: DuplexParams = DuplexParams(), *, loop=None,
                    request_id: str | None = None) -> tuple[RequestHandle, SessionInput]:
        return self._open(params, loop, request_id, playing=True)

    def _open(self, params: DuplexParams, loop, request_id: str | None,
              playing: bool) -> tuple[RequestHandle, SessionInput]:
        """A session; `playing`: live, its user hears it as it is made (`open_duplex`: admitted by
        frame deadline under slack scheduling); False: batch work (`Duplex`'s offline sessions,
        their whole input pushed at once: never gated nor paced)."""
        opts = self._options(params)
        engine = self.engine
        stream = PromptStream(wake=engine.wake)
        req = engine.stages.new_request(None, opts, request_id=request_id, stream=stream, playing=playing)
        # a queued live session would fall behind its user: refused beyond what runs at once
        handle = engine.submit(req, loop=loop, limit=self.max_sessions)
        return handle, SessionInput(req, self.frame_size, self._options)
