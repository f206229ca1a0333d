"""From a user's request to a `PreparedPrompt`: chat messages or raw ids, plus raw media.

Media are decoded and featurised here (log-mel for audio, patches for images and videos),
and the prompt gets exactly one placeholder per media token, as transformers' processor
would produce.
"""
from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnivox.audio.io import load_audio
from omnivox.audio.mel import log_mel, num_audio_tokens
from omnivox.errors import ContextTooLong, InputError
from omnivox.media_budget import DecodeBudget, MediaLimits
from omnivox.models.qwen3_omni.config import Qwen3OmniConfig
from omnivox.models.qwen3_omni.image_processor import (VisionProcessorConfig, num_vision_tokens, patch_bytes,
                                                       preprocess_image, preprocess_video, video_grid, video_size,
                                                       work_bytes)
from omnivox.models.qwen3_omni.types import AudioFeatures, PreparedPrompt, VisualItem
from omnivox.models.qwen3_omni.video import VideoLimits, load_video, load_video_patches
from omnivox.models.qwen3_omni.prompt import expand_media_tokens, media_in_order, render_messages
from omnivox.models.qwen3_omni.shield import Shield
from omnivox.models.qwen3_omni.tokenizer import load_chat_template, load_tokenizer
from omnivox.serving import MAX_CHARS_PER_TOKEN

MAX_AUDIO_SECONDS = 300  # the reference feature extractor's n_samples (4,800,000 at 16 kHz)


def _data_url_bytes(url: str) -> bytes:
    if not url.startswith("data:"):
        raise InputError("only data: URLs are accepted for media (no network fetches)")
    try:
        _, payload = url.split(",", 1)
        return base64.b64decode(payload, validate=True)
    except (ValueError, binascii.Error):
        raise InputError("media data URL is not valid base64") from None


def decode_audio(payload: Any, budget: DecodeBudget | None = None) -> np.ndarray:
    """16 kHz mono float32 from an array (taken as 16 kHz), (array, rate), a path, bytes,
    an OpenAI `input_audio` dict ({"data": base64 text, or the bytes it decodes to (the server
    decodes once), "format": ...}; the container must be that format) or a data URL. Encoded
    audio is decoded within `budget` (None: the defaults)."""
    declared = None
    if isinstance(payload, dict):
        if "data" in payload:
            declared, payload = payload.get("format"), payload["data"]
            if not isinstance(payload, (bytes, bytearray)):
                try:
                    payload = base64.b64decode(payload, validate=True)
                except (binascii.Error, TypeError, ValueError):
                    raise InputError("input_audio.data is not valid base64") from None
        elif "url" in payload:
            payload = _data_url_bytes(payload["url"])
    if isinstance(payload, str) and payload.startswith("data:"):
        payload = _data_url_bytes(payload)
    if isinstance(payload, tuple) and len(payload) == 2 and np.ndim(payload[0]) >= 1:
        wave, rate = payload
        from omnivox.audio.io import MAX_SAMPLE_RATE, MIN_SAMPLE_RATE, resample
        wave = np.asarray(wave, dtype=np.float32)
        if not MIN_SAMPLE_RATE <= int(rate) <= MAX_SAMPLE_RATE:
            raise InputError(f"audio sample rate {rate} Hz is outside {MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE} Hz")
        if wave.shape[-1] > MAX_AUDIO_SECONDS * int(rate):  # before resampling allocates
            raise InputError(f"audio longer than {MAX_AUDIO_SECONDS} s is not supported")
        wave = resample(wave, int(rate), 16000)
    elif isinstance(payload, (np.ndarray, torch.Tensor, list)):
        wave = np.asarray(payload, dtype=np.float32)
        if wave.ndim == 2:
            wave = wave.mean(axis=0 if wave.shape[0] < wave.shape[1] else 1)
    else:
        if declared is not None and not isinstance(declared, str):
            raise InputError("input_audio.format must be a string")
        wave = load_audio(payload, target_sr=16000, max_seconds=MAX_AUDIO_SECONDS, format=declared, budget=budget)
    if wave.ndim != 1 or wave.size <= 200:
        raise InputError("audio must be mono and longer than 12.5 ms (200 samples at 16 kHz)")
    if wave.size > MAX_AUDIO_SECONDS * 16000:
        raise InputError(f"audio longer than {MAX_AUDIO_SECONDS} s is not supported")
    if not np.isfinite(wave).all():
        raise InputError("audio contains NaN or infinite samples")
    return wave


def decode_image(payload: Any) -> Any:
    if isinstance(payload, dict):
        payload = payload.get("url", payload.get("image", payload))
    if isinstance(payload, str) and payload.startswith("data:"):
        return _data_url_bytes(payload)
    return payload


def _video_source(payload: Any) -> bytes | Path | tuple[np.ndarray, float]:
    """An encoded file (bytes or a Path) or (frames [T, H, W, 3] uint8, fps): see `decode_video`."""
    if isinstance(payload, dict) and isinstance(payload.get("url"), str):
        payload = payload["url"]
    if isinstance(payload, str):
        limit = VideoLimits().max_bytes
        if len(payload) > limit * 4 // 3 + 256:  # base64 of more than the limit: refused before decoding
            raise InputError(f"video data URL is larger than the {limit >> 20} MiB limit")
        payload = _data_url_bytes(payload)
    if isinstance(payload, (bytes, bytearray, Path)):
        return payload
    if isinstance(payload, dict):
        frames, fps = payload.get("frames"), payload.get("fps", 1.0)
    elif isinstance(payload, (tuple, list)) and len(payload) == 2:
        frames, fps = payload
    else:
        frames, fps = payload, 1.0
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise InputError("a video must be a [T, H, W, 3] uint8 array (with its fps)")
    if not (fps and float(fps) > 0):
        raise InputError("video fps must be positive")
    return frames, float(fps)


def decode_video(payload: Any, budget: DecodeBudget | None = None) -> tuple[np.ndarray, float]:
    """(frames [T, H, W, 3] uint8, fps) from an encoded mp4/webm file (bytes, a Path, a data URL
    or {"url": data URL}; sampled by `video.load_video`) or from frames given as an array,
    (array, fps) or {"frames", "fps"} (fps 1.0 when absent, as the reference processor assumes)."""
    source = _video_source(payload)
    return source if isinstance(source, tuple) else load_video(source, budget=budget)


def preprocess_video_input(payload: Any, cfg: VisionProcessorConfig, budget: DecodeBudget
                           ) -> tuple[torch.Tensor, tuple[int, int, int], float]:
    """`preprocess_video(*decode_video(payload))` within `budget`: an encoded file is decoded frame
    by frame into its patches (`video.load_video_patches`), after its tokens and memory are reserved."""
    source = _video_source(payload)
    if not isinstance(source, tuple):
        return load_video_patches(source, cfg, budget=budget)
    frames, fps = source
    size = video_size(frames.shape[1], frames.shape[2], cfg)
    grid = video_grid(frames.shape[0], size, cfg)
    budget.reserve(f"video of {frames.shape[0]} frames at {frames.shape[2]}x{frames.shape[1]}",
                   kept=patch_bytes(grid, cfg), transient=work_bytes(size, cfg),
                   tokens=num_vision_tokens(grid, cfg.merge_size))
    return preprocess_video(frames, fps, cfg)


class Qwen3OmniProcessor:
    def __init__(self, folder: Path, cfg: Qwen3OmniConfig, limits: MediaLimits = MediaLimits()):
        self.cfg = cfg
        self.tokenizer = load_tokenizer(folder)
        self.template = load_chat_template(folder)
        self.vision = VisionProcessorConfig.from_folder(Path(folder), cfg.thinker.vision)
        self.limits = limits  # what one request's media may cost to decode (media_budget.py)

    def budget(self) -> DecodeBudget:
        """A fresh media budget for one request: the limits' bytes and seconds, and the model's
        context for the tokens of its images and videos (priced before they are decoded)."""
        return self.limits.budget(max_tokens=self.cfg.thinker.text.max_position_embeddings or None)

    # ---- media ----
    def _audio(self, items: list[Any], budget: DecodeBudget) -> tuple[list[torch.Tensor], list[int], int | None]:
        """(log-mel per clip, audio tokens per clip, the AuT window of the prompt's clips)."""
        if any(isinstance(a, AudioFeatures) for a in items):
            feats, window = self._featurised(items)
        else:
            # NOTE: the reference featurises a prompt's clips together, padded to the longest, which
            # changes the shorter clips' features and frame counts; pad_to reproduces that.
            waves = [decode_audio(a, budget) for a in items]
            longest = max((w.shape[0] for w in waves), default=0)
            feats, window = [log_mel(w, pad_to=longest) for w in waves], None
        return feats, [num_audio_tokens(f.shape[-1], self.cfg.thinker.audio.n_window) for f in feats], window

    def _featurised(self, items: list[Any]) -> tuple[list[torch.Tensor], int | None]:
        """Clips given as `AudioFeatures`: taken as they are, one window for all of them."""
        if not all(isinstance(a, AudioFeatures) for a in items):
            raise InputError("a prompt's audio is either all raw clips or all AudioFeatures")
        windows = {a.window_chunks for a in items}
        if len(windows) > 1:
            raise InputError(f"a prompt's AudioFeatures must share one attention window, got {sorted(windows, key=str)}")
        mels = self.cfg.thinker.audio.num_mel_bins
        for a in items:
            f = a.features
            if not isinstance(f, torch.Tensor) or f.ndim != 2 or f.shape[0] != mels or f.shape[1] < 1:
                raise InputError(f"AudioFeatures.features must be a [{mels}, T >= 1] tensor")
            if not torch.isfinite(f).all():
                raise InputError("AudioFeatures.features contain NaN or infinite values")
        window = windows.pop()
        if window is not None and (int(window) != window or window < 1):
            raise InputError(f"AudioFeatures.window_chunks must be a positive integer, got {window!r}")
        return [a.features.to(torch.float32) for a in items], window

    def _visual(self, images: list[Any], videos: list[Any], budget: DecodeBudget
                ) -> tuple[list[VisualItem], list[VisualItem]]:
        imgs = []
        for im in images:
            pix, grid = preprocess_image(decode_image(im), self.vision, budget)
            imgs.append(VisualItem("image", pix, grid))
        vids = []
        for v in videos:
            pix, grid, spg = preprocess_video_input(v, self.vision, budget)
            vids.append(VisualItem("video", pix, grid, spg))
        return imgs, vids

    def _visual_in_prompt_order(self, ids: list[int], imgs: list[VisualItem], vids: list[VisualItem]) -> list[VisualItem]:
        th = self.cfg.thinker
        out, it_i, it_v = [], iter(imgs), iter(vids)
        for i, t in enumerate(ids):
            if i and ids[i - 1] == t:
                continue
            if t == th.image_token_id:
                out.append(next(it_i))
            elif t == th.video_token_id:
                out.append(next(it_v))
        return out

    # ---- requests ----
    def from_messages(self, messages: list[dict], system: str | None = None) -> PreparedPrompt:
        if self.tokenizer is None:
            raise InputError("this checkpoint has no tokenizer files: pass prompt_ids instead of messages")
        if not isinstance(messages, list) or not messages:
            raise InputError("messages must be a non-empty list of {role, content} objects")
        # message text stays text: its special-token strings never become control ids
        shield = Shield(self.tokenizer.special_strings)
        text = render_messages(shield.messages(messages), self.template, add_generation_prompt=True,
                               system=shield.text(system), template_vars=self.tokenizer.special_tokens_map)
        check_text_length(text, self.cfg.thinker.text.max_position_embeddings, "the messages")
        audios, images, videos = media_in_order(messages)
        budget = self.budget()
        feats, a_counts, window = self._audio(audios, budget)
        imgs, vids = self._visual(images, videos, budget)
        th = self.cfg.thinker
        ids = expand_media_tokens(
            self.tokenizer.encode_pieces(shield.split(text)), audio_token_id=th.audio_token_id,
            image_token_id=th.image_token_id,
            video_token_id=th.video_token_id, audio_counts=a_counts,
            image_counts=[num_vision_tokens(v.grid, self.vision.merge_size) for v in imgs],
            video_counts=[num_vision_tokens(v.grid, self.vision.merge_size) for v in vids])
        return PreparedPrompt(ids, feats, a_counts, audio_window_chunks=window,
                              visual=self._visual_in_prompt_order(ids, imgs, vids))

    def from_ids(self, ids: list[int], audio=(), images=(), videos=()) -> PreparedPrompt:
        vocab = self.cfg.thinker.text.vocab_size
        try:
            ids = [int(t) for t in ids]
        except (TypeError, ValueError):
            raise InputError("prompt_ids must be a list of integers") from None
        if not ids:
            raise InputError("prompt_ids is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InputError(f"prompt id {bad[0]} is outside the vocabulary [0, {vocab})")
        budget = self.budget()
        feats, a_counts, window = self._audio(list(audio), budget)
        imgs, vids = self._visual(list(images), list(videos), budget)
        th = self.cfg.thinker
        for tok, counts, what in ((th.audio_token_id, a_counts, "audio"),
                                  (th.image_token_id, [num_vision_tokens(v.grid, self.vision.merge_size) for v in imgs], "image"),
                                  (th.video_token_id, [num_vision_tokens(v.grid, self.vision.merge_size) for v in vids], "video")):
            runs = placeholder_runs(ids, tok)
            if runs != counts:
                raise InputError(f"{what}: prompt_ids hold placeholder runs of lengths {runs}, "
                                 f"but the supplied {what} need {counts} tokens")
        return PreparedPrompt(ids, feats, a_counts, audio_window_chunks=window,
                              visual=self._visual_in_prompt_order(ids, imgs, vids))


def check_text_length(text: str, context: int | None, what: str) -> None:
    """Refuse text that cannot fit `context` tokens, before any tokenizing."""
    if context and len(text) > MAX_CHARS_PER_TOKEN * context:
        raise ContextTooLong(f"{what} hold {len(text)} characters, more than can fit the model's context of "
                             f"{context} tokens (at most {MAX_CHARS_PER_TOKEN} characters per token)")


def placeholder_runs(ids: list[int], tok: int) -> list[int]:
    runs, n = [], 0
    for t in ids + [None]:
        if t == tok:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def read_generation_config(folder: Path) -> dict:
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}
