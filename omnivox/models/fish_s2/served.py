"""Fish Audio S2 Pro served: the serving protocols (`omnivox.serving.ServedModel`, `VoiceCloner`)
over a loaded checkpoint, and nothing else. `FishS2Checkpoint` loads the weights and states the
model card's facts; `FishS2Served` turns text (and reference voices) into engine requests. The
offline verbs (`speak`, `stream`) are `omnivox.offline`'s, over any served model.

NOTE: the S2 Pro weights are licensed for research and non-commercial use only (Fish Audio
Research License); commercial use, hosted services included, needs a licence from Fish Audio.
"""
from __future__ import annotations

import hashlib
import math
import sys
import threading
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from omnivox.engine.config import EngineConfig
from omnivox.engine.owner import EngineOwner
from omnivox.engine.handle import RequestHandle
from omnivox.engine.placement import Placement
from omnivox.errors import CheckpointError, InputError
from omnivox.media_budget import MediaLimits
from omnivox.models.fish_s2 import LICENSE_NOTICE
from omnivox.models.fish_s2.codec import ReferenceEncoding
from omnivox.models.fish_s2.family import FAMILY
from omnivox.models.fish_s2.prompt import Reference, TextTokenizer, build_prompt
from omnivox.models.fish_s2.sampler import MODES, FishSamplingParams
from omnivox.models.fish_s2.stages import SpeechPrompt, TTSOptions
from omnivox.models.fish_s2.stages.graph import served_graph
from omnivox.models.fish_s2.voice import Voice
from omnivox.models.fish_s2.weights import load_codec, load_llm
from omnivox.serving import SpeechParams, stage_weight_bytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
MAX_REFERENCE_SECONDS = 120.0
REFERENCE_CACHE_SIZE = 64
DEFAULT_MAX_FRAMES = 1024  # fish-speech's API default
SPEECH_OPTIONS = frozenset({"mode", "greedy_residual", "mask_residual_overflow", "ignore_eos"})


class FishS2Checkpoint:
    """A loaded S2 checkpoint (slow AR, fast AR, codec, tokenizer) and the facts the server states
    of it (`ServedModel`'s)."""

    family = FAMILY
    builtin_voices = ["default"]
    default_voice = "default"
    modalities = ["audio"]

    def __init__(self, model: str | Path | None = None, dtype: str = "float32", device: str = "cpu",
                 progress: bool = True, engine_config: EngineConfig | None = None,
                 placement: str | dict | Placement | None = None, quantization: str | None = None,
                 fp8_compute: str = "auto"):
        """`placement`: a device per stage (`slow_ar` with the fast AR, `vocoder`: the codec), the
        others on `device` (engine/placement.py). `quantization="fp8"`: both ARs' decoder linears in
        block FP8 (`layers.fp8`), quantized at load; `fp8_compute`: how they compute."""
        if model is None:
            from omnivox.models.fish_s2.demo import fish_demo_path
            model = fish_demo_path()
        if dtype not in DTYPES:
            raise CheckpointError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        if engine_config is not None and engine_config.speculative is not None:
            raise InputError("speculative decoding drafts a Thinker's text; S2 has no Thinker (drop the speculative "
                             "config)")
        self.folder = Path(model)
        self.is_demo = (self.folder / "OMNIVOX_DEMO").exists()
        if progress and not self.is_demo:
            print(f"note: {LICENSE_NOTICE}", file=sys.stderr)
        self.placement = Placement.parse(placement, device).check(FAMILY.stages)
        self.cfg, self.slow, self.fast = load_llm(self.folder, dtype=DTYPES[dtype], device=self.placement.device("slow_ar"),
                                                  quantization=quantization, fp8_compute=fp8_compute)
        # the codec stays fp32 (spec 12.8) unless the whole model runs in fp64 (exactness tests)
        codec_dtype = torch.float64 if dtype == "float64" else torch.float32
        self.codec = load_codec(self.folder / "codec.pth", device=self.placement.device("vocoder"), dtype=codec_dtype)
        self.tokenizer = TextTokenizer(self.folder)
        self.engine_config = engine_config or EngineConfig()
        self.kv_budget = None  # engine/memory.py's KVBudget when registry.load sized the KV from the device
        self.media_limits = MediaLimits()  # what a reference clip may cost to decode (media_budget.py)
        self._ref_cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._ref_lock = threading.Lock()

    @property
    def sample_rate(self) -> int:
        return self.codec.cfg.sample_rate

    @property
    def default_max_frames(self) -> int:
        return DEFAULT_MAX_FRAMES

    @property
    def max_model_len(self) -> int:
        return self.cfg.text.max_seq_len

    @property
    def frame_rate(self) -> float:
        """Codec frames per second of audio (S2: 44100 / 2048, about 21.5)."""
        return self.sample_rate / self.codec.cfg.hop_length

    @property
    def audio_context_frames(self) -> int:
        """The most frames one reply can hold: the slow AR's context (one position a frame)."""
        return self.cfg.text.max_seq_len

    def parameter_count(self) -> int:
        return sum(p.numel() for m in (self.slow, self.fast, self.codec) for p in m.parameters())

    def weight_bytes(self) -> dict[str, dict[str, int]]:
        return stage_weight_bytes({"slow_ar": [self.slow, self.fast], "vocoder": [self.codec]})

    def default_kv_mb(self) -> float:
        """4096 MB (S2 Pro's bf16 slow AR: ~144 KiB per token, ~29k tokens), or less when
        max_running whole contexts need less (the tiny demo): never a pool larger than usable."""
        from omnivox.kv_cache.pool import KVPool
        t, cfg = self.cfg.text, self.engine_config
        per_token = KVPool.bytes_per_block(t.n_layer, 1, t.n_local_heads, t.head_dim, self.slow.norm.weight.dtype)
        return min(4096.0, math.ceil(cfg.max_running * (t.max_seq_len + cfg.block_size) * per_token / 2**20))

    def kv_summary(self) -> str:
        from omnivox.models.fish_s2.stages.dual_ar import kv_blocks
        cfg = self.engine_config
        pages = kv_blocks(self.slow, cfg)
        return f"slow AR {pages} pages ({pages * cfg.block_size} tokens, {cfg.kv_cache_mb:g} MB)"

    def describe(self) -> list[str]:
        lines = [f"Fish S2 (text to speech, {self.sample_rate} Hz); context {self.max_model_len} tokens"]
        return lines if self.is_demo else [*lines, f"note: {LICENSE_NOTICE}"]

    def bench_workload(self, args):
        from omnivox.models.fish_s2.bench import FishWorkload
        return FishWorkload(self, args)


class FishS2Served(EngineOwner, FishS2Checkpoint):
    """S2 as `omnivox.serving.ServedModel` and `VoiceCloner`: text, in the default voice or voices
    cloned from reference clips, becomes an engine request; `build_prompt` and `options` are its
    steps."""

    def build_graph(self):
        return served_graph(self, self.engine_config)

    def options(self, params: SpeechParams = SpeechParams(), *, mode: str = "fish",
                greedy_residual: bool | None = None, mask_residual_overflow: bool = False,
                ignore_eos: bool = False) -> TTSOptions:
        """Defaults are fish-speech's API values: temperature 0.8, top_p 0.8, top_k 30, 1024 frames.
        mode "fish" (fish-speech sampler and prompt) or "sglang" (SGLang-Omni 0.1.9's)."""
        if mode not in MODES:
            raise InputError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if params.instructions:
            raise InputError("instructions are not supported by S2 (write inline tags in the input instead); "
                             "remove `instructions`", param="instructions", code="unsupported_parameter")
        kw: dict[str, Any] = {"mode": mode, "mask_residual_overflow": bool(mask_residual_overflow)}
        for name in ("seed", "temperature", "top_p", "top_k", "repetition_penalty"):
            if getattr(params, name) is not None:
                kw[name] = getattr(params, name)
        if greedy_residual is not None:
            kw["greedy_residual"] = bool(greedy_residual)
        frames = DEFAULT_MAX_FRAMES if params.max_frames is None else int(params.max_frames)
        # FishSamplingParams checks the ranges
        return TTSOptions(FishSamplingParams(**kw), frames, bool(ignore_eos), bool(params.playing))

    def encode_voice(self, audio: str | Path | bytes | np.ndarray, transcript: str) -> Voice:
        """A reference clip (file path, encoded bytes in any format soundfile reads, or a float
        mono array at 44.1 kHz) and its transcript -> a `Voice` (codec codes + text)."""
        if not isinstance(transcript, str):
            raise InputError("a reference voice needs its transcript as a string")
        return Voice(self._reference_codes(audio), transcript)

    def _reference_codes(self, audio) -> np.ndarray:
        from omnivox.audio.io import load_audio

        if isinstance(audio, (str, Path)):
            path = Path(audio)
            if not path.is_file():
                raise InputError(f"reference audio {path} not found")
            audio = path.read_bytes()
        if isinstance(audio, (bytes, bytearray)):
            key = hashlib.sha1(bytes(audio)).hexdigest()
            wave = None
        elif isinstance(audio, np.ndarray):
            wave = np.asarray(audio, dtype=np.float32)
            if wave.ndim != 1 or wave.size == 0 or not np.isfinite(wave).all():
                raise InputError("reference audio array must be 1-D, non-empty, finite float samples at 44.1 kHz")
            key = "pcm:" + hashlib.sha1(wave.tobytes()).hexdigest()
        else:
            raise InputError(f"reference audio must be a path, bytes or a numpy array, got {type(audio).__name__}")
        with self._ref_lock:
            if key in self._ref_cache:
                self._ref_cache.move_to_end(key)
                return self._ref_cache[key]
        if wave is None:
            wave = load_audio(bytes(audio), target_sr=self.sample_rate, max_seconds=MAX_REFERENCE_SECONDS,
                              budget=self.media_limits.budget())
        if wave.shape[0] > MAX_REFERENCE_SECONDS * self.sample_rate:
            raise InputError(f"reference audio is {wave.shape[0] / self.sample_rate:.1f} s; "
                             f"the limit is {MAX_REFERENCE_SECONDS:.0f} s")
        codes = self.engine.encoder.encode(ReferenceEncoding(self.codec), wave)  # model code: the engine thread
        with self._ref_lock:
            self._ref_cache[key] = codes
            while len(self._ref_cache) > REFERENCE_CACHE_SIZE:
                self._ref_cache.popitem(last=False)
        return codes

    def _check_voice(self, voice: Voice) -> Voice:
        c, cc = voice.codes, self.codec.cfg
        if c.shape[0] != self.cfg.num_codebooks:
            raise InputError(f"voice has {c.shape[0]} codebooks; this model uses {self.cfg.num_codebooks}")
        if int(c[0].max()) >= cc.semantic_codebook_size or (c.shape[0] > 1 and int(c[1:].max()) >= cc.codebook_size):
            raise InputError("voice codes are out of this model's codebook range (encoded by another codec?)")
        return voice

    def _as_voice(self, ref, codes) -> Voice:
        if isinstance(ref, Voice):
            return ref
        if isinstance(ref, dict):
            if set(ref) - {"audio", "text"}:
                raise InputError("a reference dict takes the keys 'audio' and 'text'")
            ref = (ref.get("audio"), ref.get("text"))
        if not (isinstance(ref, (tuple, list)) and len(ref) == 2):
            raise InputError("each reference must be a Voice, an (audio, transcript) pair or {'audio', 'text'}")
        audio, text = ref
        if not isinstance(text, str):
            raise InputError("each reference needs its transcript as a string")
        if codes is not None:
            return Voice(np.asarray(codes), text)
        if audio is None:
            raise InputError("a reference needs its audio (or precomputed codes=)")
        return Voice(self._reference_codes(audio), text)

    def prepare(self, *args, **kwargs):
        """Deprecated name of `build_prompt` (kept one release)."""
        warnings.warn("FishTTS.prepare is now FishTTS.build_prompt; prepare goes in the next release", DeprecationWarning,
                      stacklevel=2)
        return self.build_prompt(*args, **kwargs)

    def build_prompt(self, text: str, references: Sequence[Any] | None = None, codes: Sequence[Any] | None = None,
                mode: str = "fish") -> SpeechPrompt:
        """The exact S2 prompt for `text`. references: `Voice`s, (audio, transcript) pairs or
        {"audio", "text"} dicts; their audio is encoded with the codec (cached by content).
        codes: optional precomputed codes [num_codebooks, frames], one per reference, used
        instead of encoding that reference's audio."""
        if not isinstance(text, str) or not text.strip():
            raise InputError("text to speak must be a non-empty string")
        refs = list(references or [])
        if codes is not None and len(codes) != len(refs):
            raise InputError(f"codes= holds {len(codes)} entries for {len(refs)} references")
        voices = [self._check_voice(self._as_voice(r, None if codes is None else codes[i])) for i, r in enumerate(refs)]
        matrix = build_prompt(self.tokenizer, self.cfg, text,
                              [Reference(v.text, torch.from_numpy(v.codes)) for v in voices], mode=mode)
        limit = self.cfg.max_prompt_len
        if matrix.shape[1] > limit:
            raise InputError(f"prompt is {matrix.shape[1]} tokens (text plus reference codes); the limit is {limit}")
        return SpeechPrompt(text, matrix)

    def check_speech(self, params: SpeechParams) -> None:
        self.options(params)

    def speech(self, text: str, params: SpeechParams = SpeechParams(), *, voice: Any = None,
               references: Sequence[Any] = (), loop=None, request_id: str | None = None, **options) -> RequestHandle:
        """Text to speech in `voice` ("default"/None: the model's own voice, or a saved `Voice`)
        plus per-request `references`: (audio, transcript) pairs (encoded audio bytes; offline also
        a path or a float array at 44.1 kHz), {"audio", "text"} dicts or `Voice`s. `options`:
        `options`' keywords (mode, greedy_residual, mask_residual_overflow, ignore_eos)."""
        unknown = sorted(set(options) - SPEECH_OPTIONS)
        if unknown:
            raise InputError(f"unknown S2 speech option(s): {', '.join(unknown)}; S2 takes {', '.join(sorted(SPEECH_OPTIONS))}")
        try:
            opts = self.options(params, **options)  # every range checked before any reference is encoded
        except InputError as e:
            raise InputError(str(e), param=e.param, code=e.code or "invalid_value") from None
        refs: list[Voice] = []
        if isinstance(voice, Voice):
            refs.append(voice)
        elif voice not in (None, "default"):
            raise InputError(f"unknown voice {voice!r:.80}; use 'default' or a saved voice (GET /v1/audio/voices)",
                             param="voice", code="invalid_voice")
        for i, ref in enumerate(references or ()):
            try:
                refs.append(self._as_voice(ref, None))
            except InputError as e:
                raise InputError(f"references[{i}].audio: {e}", param=f"references[{i}].audio",
                                 code="invalid_audio") from None
        prompt = self.build_prompt(text, refs, mode=opts.sampling.mode)
        return self.engine.submit(self.engine.stages.new_request(prompt, opts, request_id=request_id), loop=loop)

    def voice_to_bytes(self, voice: Voice) -> bytes:
        return voice.to_bytes()

    def voice_from_bytes(self, data: bytes) -> Voice:
        return Voice.from_bytes(data)
