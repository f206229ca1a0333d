"""The per-request media decode budget (omnivox/media_budget.py): every loader prices its input
from the container's header and refuses, before decoding, what would pass the budget's bytes or
the model's context; decoding then goes frame by frame (video) or block by block (audio), prices
a frame that is larger than its header says, and stops at the budget's deadline. Under the budget
the values are exactly those of decoding everything first."""
from __future__ import annotations

import io
import itertools

import av
import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from media_helpers import make_video, mjpeg, pattern
from omnivox.audio import io as audio_io
from omnivox.audio.io import load_audio, resample
from omnivox.errors import ContextTooLong, InputError
from omnivox.media_budget import DecodeBudget, MediaLimits
from omnivox.models.qwen3_omni import image_processor as image_mod
from omnivox.models.qwen3_omni import video as video_mod
from omnivox.models.qwen3_omni.image_processor import VisionProcessorConfig, preprocess_image, preprocess_video
from omnivox.models.qwen3_omni.processor import decode_audio, preprocess_video_input
from omnivox.models.qwen3_omni.video import load_video, load_video_patches

CFG = VisionProcessorConfig(16, 2, 2, 56 * 56, 28 * 28 * 1280, (0.48145466, 0.4578275, 0.40821073),
                            (0.26862954, 0.26130258, 0.27577711))


def jpeg(w: int, h: int, i: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pattern(i, h, w)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture
def no_decoding(monkeypatch):
    """Fails the test if a frame, a sample block or a picture is decoded: the budget must refuse first."""
    def refuse(*_a, **_k):
        raise AssertionError("decoding started before the budget was checked")
    monkeypatch.setattr(video_mod, "_decode", refuse)
    monkeypatch.setattr(audio_io, "_read_mono", refuse)
    monkeypatch.setattr(image_mod.ImageOps, "exif_transpose", refuse)


# ---- video ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,codec,frames", [("mp4", "libx264", 30), ("mp4", "mpeg4", 7), ("webm", "libvpx", 13),
                                              ("webm", "libvpx-vp9", 1)])
def test_frame_by_frame_patches_equal_decoding_everything_first(fmt, codec, frames):
    data = make_video(fmt, codec, frames=frames, w=96, h=64, audio=False)
    pixels, grid, second_per_grid = load_video_patches(data, CFG)
    ref_pixels, ref_grid, ref_spg = preprocess_video(*load_video(data), CFG)
    assert torch.equal(pixels, ref_pixels) and grid == ref_grid and second_per_grid == ref_spg


def test_intra_only_frames_not_kept_are_not_decoded(monkeypatch):
    """mjpeg: only the sampled frames' packets reach the decoder, and they are the right frames."""
    data = mjpeg([jpeg(96, 64, i) for i in range(40)], 96, 64)  # 4 s at 10 fps: 8 frames kept
    decoded = []
    real = av.Packet.decode
    monkeypatch.setattr(av.Packet, "decode", lambda self: decoded.append(self.pts and self.pts * self.time_base * 10)
                        or real(self))  # the frame's index, from its time stamp
    frames, fps = load_video(data)
    kept = video_mod.sample_indices(40, 10.0)
    assert [p for p in decoded if p is not None] == kept and fps == pytest.approx(2.0)
    for k, i in enumerate(kept):
        assert np.abs(frames[k].astype(int) - pattern(i, 64, 96)).mean() < 8


def test_video_bytes_and_tokens_are_refused_before_decoding(no_decoding):
    data = make_video(frames=30, w=96, h=64, audio=False)  # 6 frames kept, resized to 448x320: 420 tokens
    with pytest.raises(InputError, match=r"video of 6 frames at 96x64 \(resized to 448x320\) needs 23.9 MiB .* "
                                         "budget is 10.0 MiB"):
        load_video_patches(data, CFG, budget=DecodeBudget(max_bytes=10 << 20))
    with pytest.raises(ContextTooLong, match="would be 420 tokens, more than the model's context of 200 tokens"):
        load_video_patches(data, CFG, budget=DecodeBudget(max_tokens=200))
    with pytest.raises(InputError, match="video of 6 frames at 96x64 needs .* budget is 102400 bytes"):
        load_video(data, budget=DecodeBudget(max_bytes=100 << 10))


def test_a_request_budget_counts_all_its_media():
    data = make_video(frames=30, w=96, h=64, audio=False)
    budget = DecodeBudget(max_tokens=1000)
    preprocess_video_input(data, CFG, budget)
    preprocess_video_input((np.zeros((6, 64, 96, 3), np.uint8), 2.0), CFG, budget)  # arrays count too
    assert budget.tokens == 840 and budget.kept == 2 * (3 * 20 * 28) * 1536 * 4  # two grids of (3, 20, 28)
    with pytest.raises(ContextTooLong, match=r"420 tokens \(with 840 from this request's other media\)"):
        preprocess_video_input(data, CFG, budget)
    small = DecodeBudget(max_bytes=30 << 20)
    load_video_patches(data, CFG, budget=small)  # 9.8 MiB kept, 14 MiB more at work
    with pytest.raises(InputError, match="on top of 9.8 MiB for this request's other media"):
        load_video_patches(make_video(frames=30, w=960, h=640, audio=False), CFG, budget=small)


def test_frames_that_grow_past_the_header_are_refused():
    small = jpeg(64, 64)
    with pytest.raises(InputError, match="larger than the limit of 8294400 pixels"):
        load_video_patches(mjpeg([small, jpeg(4000, 2200), small, small]), CFG)  # 8.8 M pixels: over 4K
    grown = mjpeg([small, jpeg(1920, 1080), small, small])  # within 4K, but over this budget
    with pytest.raises(InputError, match=r"video frame 1 of 1920x1080 \(its header says 64x64\) needs"):
        load_video_patches(grown, CFG, budget=DecodeBudget(max_bytes=24 << 20))
    pixels, grid, _ = load_video_patches(grown, CFG)  # within the default budget: scaled to the header's size
    assert grid == (2, 24, 24) and pixels.shape == (2 * 24 * 24, 1536)


def test_decoding_stops_at_the_deadline():
    ticks = itertools.count()
    budget = DecodeBudget(max_seconds=5, clock=lambda: float(next(ticks)))  # one second per look at the clock
    with pytest.raises(InputError, match="took longer than 5 s, the per-request media decode time limit"):
        load_video_patches(make_video(frames=30, audio=False), CFG, budget=budget)


# ---- images ---------------------------------------------------------------------------------------
def test_images_are_priced_from_their_header(no_decoding):
    buf = io.BytesIO()
    Image.new("L", (9000, 9000)).save(buf, "PNG")  # ~80 KB that decode to 81 M pixels
    with pytest.raises(InputError, match="image bytes of 9000x9000 needs 1.0 GiB .* budget is 512.0 MiB"):
        preprocess_image(buf.getvalue(), CFG)
    png = io.BytesIO()
    Image.fromarray(pattern(3, 64, 96)).save(png, "PNG")
    with pytest.raises(ContextTooLong, match="image bytes of 96x64 would be 6 tokens, more than the model's context of"):
        preprocess_image(png.getvalue(), CFG, DecodeBudget(max_tokens=5))


# ---- audio ----------------------------------------------------------------------------------------
def encoded(fmt: str, subtype: str | None = None, rate: int = 16000, seconds: float = 0.5, channels: int = 1) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    x = np.stack([0.3 * np.sin(2 * np.pi * (300 + 50 * c) * t) for c in range(channels)], axis=1)
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def test_the_declared_format_must_be_the_container():
    for fmt in ("AIFF", "CAF", "AU", "W64", "FLAC", "OGG"):
        with pytest.raises(InputError, match="declared wav but is not a RIFF/WAVE file"):
            load_audio(encoded(fmt), format="wav")
    for declared, fmt in (("flac", "WAV"), ("ogg", "FLAC"), ("mp3", "OGG"), ("wav", "MP3")):
        with pytest.raises(InputError, match=f"declared {declared} but"):
            load_audio(encoded(fmt), format=declared)
    with pytest.raises(InputError, match="'aiff' is not supported"):
        load_audio(encoded("AIFF"), format="aiff")
    for declared, fmt, subtype in (("wav", "WAV", None), ("wav", "WAVEX", None), ("wav", "RF64", None),
                                   ("flac", "FLAC", None), ("ogg", "OGG", "VORBIS"), ("mp3", "MP3", None),
                                   ("WAV", "WAV", None)):
        data = encoded(fmt, subtype)
        assert np.array_equal(load_audio(data, format=declared), load_audio(data)), (declared, fmt)
    aiff = {"data": __import__("base64").b64encode(encoded("AIFF")).decode(), "format": "wav"}
    with pytest.raises(InputError, match="declared wav"):
        decode_audio(aiff)  # the chat API's input_audio part


@pytest.mark.parametrize("rate,channels", [(16000, 1), (44100, 2), (48000, 6)])
def test_block_by_block_equals_decoding_everything_first(monkeypatch, rate, channels):
    monkeypatch.setattr(audio_io, "BLOCK_FRAMES", 1000)  # many blocks, the last one partial
    data = encoded("WAV", "FLOAT", rate, 1.3, channels)
    whole, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    mono = whole.mean(axis=1) if channels > 1 else whole[:, 0]
    ref = np.clip(resample(mono, sr, 16000) if sr != 16000 else mono, -1, 1).astype(np.float32)
    assert np.array_equal(load_audio(data), ref)


def test_audio_is_priced_from_its_header(no_decoding):
    data = encoded("FLAC", rate=48000, seconds=10, channels=2)
    kept, transient = audio_io.decode_cost(480000, 48000, 2, 16000)
    assert kept == 160000 * 4 and transient == 65536 * 2 * 4 + 480000 * 12 + 160000 * 12
    with pytest.raises(InputError, match=r"\(10.0 s at 48000 Hz, 2 channels\) needs 8.4 MiB .* budget is 8.0 MiB"):
        load_audio(data, budget=DecodeBudget(max_bytes=8 << 20))
    budget = MediaLimits(max_decode_bytes=12 << 20).budget()
    budget.reserve("an image", kept=4 << 20)
    with pytest.raises(InputError, match="needs 8.4 MiB of memory to decode and preprocess on top of 4.0 MiB"):
        load_audio(data, budget=budget, format="flac")


def test_default_budget_refuses_a_high_rate_bomb(no_decoding):
    """384 kHz, 8 channels, 300 s of silence: ~1 MB of FLAC that would take 3.7 GB to decode whole."""
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", 384000, 8, format="FLAC", subtype="PCM_16") as f:
        f.write(np.zeros((1000, 8), np.int16))
    data = bytearray(buf.getvalue())
    # STREAMINFO's 36-bit total-samples field (bytes 21-25 of the file): claim 300 s
    total = 300 * 384000
    packed = int.from_bytes(data[21:26], "big") & ~((1 << 36) - 1) | total
    data[21:26] = packed.to_bytes(5, "big")
    assert sf.info(io.BytesIO(bytes(data))).frames == total
    with pytest.raises(InputError, match=r"\(300.0 s at 384000 Hz, 8 channels\) needs 1.4 GiB .* budget is 512.0 MiB"):
        load_audio(bytes(data))
