"""Video decoding for Qwen3-Omni: mp4 (h264, mpeg4) and webm (vp8, vp9) made here with PyAV,
the frame-sampling rule, the limits (checked before decoding) and corrupt input."""
import base64
import io
import os

import av
import numpy as np
import pytest

from media_helpers import make_video, pattern
from omnivox.errors import InputError
from omnivox.models.qwen3_omni import video as video_mod
from omnivox.models.qwen3_omni.image_processor import VisionProcessorConfig, preprocess_video
from omnivox.models.qwen3_omni.processor import decode_video
from omnivox.models.qwen3_omni.video import VideoLimits, load_video, sample_indices

CODECS = [("mp4", "libx264"), ("mp4", "mpeg4"), ("webm", "libvpx"), ("webm", "libvpx-vp9")]


def index_of(frame: np.ndarray) -> float:
    h, w, _ = frame.shape
    return float(frame[4: h // 2 - 4, 4: w - 4].mean()) / 8  # inside the grey half, away from edges


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return make_video()


def test_sample_indices_rule():
    assert sample_indices(30, 10.0) == [0, 5, 10, 15, 20, 25]  # 3 s at 2 fps
    assert sample_indices(30, 10.0, fps=1.0) == [0, 7, 15, 22]  # 3 frames -> min_frames 4
    assert sample_indices(7, 1.0) == [0, 1, 2, 3, 4, 5]  # at most the file's frames, even count
    assert sample_indices(3, 30.0) == [0, 1] and sample_indices(1, 30.0) == [0]
    long = sample_indices(36_000, 60.0)  # 600 s at 60 fps: 1200 at 2 fps, capped at 768
    assert len(long) == 768 and long[:3] == [0, 46, 93] and long[-1] < 36_000
    for total, src in ((2000, 24.0), (101, 29.97), (12, 25.0), (5, 5.0)):
        idx = sample_indices(total, src)
        assert len(idx) % 2 == 0 and idx[0] == 0 and all(a < b for a, b in zip(idx, idx[1:])) and idx[-1] < total
        assert len(idx) == min(max(int(total / src * 2) // 2 * 2, 4), total // 2 * 2)


@pytest.mark.parametrize("fmt,codec", CODECS)
def test_decodes_every_codec_with_the_sampling_rule(fmt, codec):
    data = make_video(fmt, codec)
    frames, fps = load_video(data)
    assert frames.dtype == np.uint8 and frames.shape == (6, 48, 64, 3) and fps == pytest.approx(2.0)
    for k, i in enumerate([0, 5, 10, 15, 20, 25]):  # the sampled frames, in order (audio ignored)
        assert round(index_of(frames[k])) == i  # this frame, not a neighbour
        assert np.abs(frames[k].astype(int) - pattern(i, 48, 64)).mean() < 8


def test_fps_and_max_frames_options(mp4):
    frames, fps = load_video(mp4, fps=1.0)
    assert frames.shape[0] == 4 and fps == pytest.approx(4 / 3)  # 4 frames over the 3 s
    frames, fps = load_video(mp4, max_frames=4)
    assert frames.shape[0] == 4
    frames, fps = load_video(make_video(frames=1, audio=False))
    assert frames.shape == (1, 48, 64, 3) and fps == 10.0
    with pytest.raises(InputError, match="fps > 0"):
        load_video(mp4, fps=0)


def test_frames_feed_the_processor_and_data_urls(mp4):
    url = "data:video/mp4;base64," + base64.b64encode(mp4).decode()
    frames, fps = decode_video({"url": url})
    same, _ = load_video(mp4)
    assert np.array_equal(frames, same) and np.array_equal(decode_video(url)[0], same)
    cfg = VisionProcessorConfig(16, 2, 2, 56 * 56, 28 * 28 * 1280, (0.5,) * 3, (0.5,) * 3)
    _, grid, second_per_grid = preprocess_video(frames, fps, cfg)
    assert grid[0] == 3 and second_per_grid == pytest.approx(1.0)  # 6 frames at 2 fps: 3 grids of 1 s
    with pytest.raises(InputError, match="only data: URLs"):
        decode_video({"url": "https://example.com/a.mp4"})


@pytest.fixture
def no_decoding(monkeypatch):
    """Fails the test if any frame would be decoded: limits must refuse before that."""
    def refuse(*_a, **_k):
        raise AssertionError("decoding started before the limit was checked")
    monkeypatch.setattr(video_mod, "_decode", refuse)


@pytest.mark.parametrize("limit,words", [
    (dict(max_bytes=1000), "the limit is 1000 bytes"),
    (dict(max_seconds=2.0), "3.0 s long; the limit is 2 s"),
    (dict(max_frame_pixels=64 * 47), "64x48; the limit is 3008 pixels"),
    (dict(max_source_frames=29), "more than 29 frames"),
    (dict(max_kept_bytes=5 * 64 * 48 * 3), "would keep 6 frames"),
])
def test_limits_refuse_before_decoding(mp4, no_decoding, limit, words):
    with pytest.raises(InputError, match=words):
        load_video(mp4, limits=VideoLimits(**limit))


def test_limits_that_hold_let_it_decode(mp4):
    frames, _ = load_video(mp4, limits=VideoLimits(max_bytes=len(mp4), max_seconds=3.0, max_frame_pixels=64 * 48,
                                                   max_source_frames=30, max_kept_bytes=6 * 64 * 48 * 3))
    assert frames.shape[0] == 6


def test_aspect_ratio_and_default_limits(no_decoding):
    with pytest.raises(InputError, match="aspect ratio 404x2"):
        load_video(make_video(frames=2, w=404, h=2, audio=False))
    d = VideoLimits()
    assert (d.max_bytes, d.max_seconds, d.max_frame_pixels, d.max_source_frames) == (64 << 20, 600.0, 3840 * 2160,
                                                                                    36_000)
    big = "data:video/mp4;base64," + "A" * (d.max_bytes * 4 // 3 + 300)
    with pytest.raises(InputError, match="larger than the 64 MiB limit"):
        decode_video(big)


def audio_only_mp4() -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        a = c.add_stream("aac", rate=48000)
        a.layout = "mono"
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 4800), np.float32), format="fltp", layout="mono")
        frame.sample_rate, frame.pts = 48000, 0
        for p in [*a.encode(frame), *a.encode(None)]:
            c.mux(p)
    return buf.getvalue()


def test_corrupt_and_unsupported_input(mp4):
    cases = {
        b"": "empty",
        os.urandom(4096): "not an mp4/mov or webm/mkv",
        b"RIFF\x00\x00\x00\x00WAVEfmt " + bytes(64): "not an mp4/mov or webm/mkv",
        mp4[:8] + os.urandom(4000): "corrupt or cannot be decoded",
        mp4[: len(mp4) // 3]: "corrupt or cannot be decoded",  # cut inside the header
        mp4[: len(mp4) // 2]: "no readable video stream .found: data.; it is audio-only, truncated",
        audio_only_mp4(): "no readable video stream .found: audio.",
    }
    for data, words in cases.items():
        with pytest.raises(InputError, match=words):
            load_video(data)
    with pytest.raises(InputError, match="encoded bytes"):
        load_video("clip.mp4")


def test_damaged_payload_fails_cleanly_or_decodes():
    """Flipped bytes inside the coded frames: ffmpeg may conceal the damage; either way the
    caller gets frames of the promised shape or an InputError, never another exception."""
    data = bytearray(make_video("webm", "libvpx"))
    for i in range(len(data) // 3, 2 * len(data) // 3, 7):
        data[i] ^= 0xFF
    try:
        frames, _ = load_video(bytes(data))
    except InputError:
        return
    assert frames.ndim == 4 and frames.shape[1:] == (48, 64, 3)
