"""Video files (mp4/mov or webm/mkv bytes, e.g. a data: URL's payload) -> sampled RGB frames
`(frames [T, H, W, 3] uint8, fps)` for `preprocess_video`, decoded with PyAV (ffmpeg).

Sampling follows transformers' `Qwen2VLVideoProcessor.sample_frames` (the video processor
`Qwen3OmniMoeProcessor` uses) at the rate Qwen's own tooling samples at, 2 frames per second:

    n = total / source_fps * fps, clamped to [min_frames 4, max_frames 768] and to the file's
        frame count, then rounded down to a multiple of temporal_patch_size (2)
    indices = arange(0, total, total / n)        (float32, truncated to int; frame 0 first)

and the fps returned is that of the sampled frames, n * source_fps / total (what Qwen's tooling
passes on, so temporal positions follow real time: second_per_grid = 2 / fps). A file with a
single frame gives that frame (`preprocess_video` repeats it to fill the temporal patch).

Only the first video stream is read; audio tracks are ignored (no `use_audio_in_video`). Frames
keep the stream's coded size (rotation metadata is not applied) and are converted to RGB by
swscale; resizing is `preprocess_video`'s job.

NOTE: every limit is checked before a frame is decoded: the byte size first, then the
container header (size, aspect ratio, duration) and an exact frame count from one demux pass
(packets, no decoding), which bounds the memory of the kept frames; decoding then stops at the
last sampled frame. Only the mp4/mov and Matroska/webm demuxers are ever opened (chosen from
the magic bytes), so a payload can never make ffmpeg read playlists, other files or URLs.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from omnivox.errors import InputError
from omnivox.models.qwen3_omni.image_processor import MAX_ASPECT_RATIO

SAMPLE_FPS = 2.0
MIN_FRAMES, MAX_FRAMES = 4, 768  # Qwen2VLVideoProcessor.min_frames / max_frames
TEMPORAL_PATCH = 2
MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip")  # what an mp4/mov may start with
EBML_MAGIC = b"\x1a\x45\xdf\xa3"  # Matroska / webm


@dataclass(frozen=True)
class VideoLimits:
    """What one video input may cost; all checked before decoding."""

    max_bytes: int = 64 << 20  # the encoded file
    max_seconds: float = 600.0  # the container's duration
    max_frame_pixels: int = 3840 * 2160  # coded width * height (4K UHD)
    max_source_frames: int = 36_000  # frames in the file (600 s at 60 fps): bounds decode time
    max_kept_bytes: int = 1 << 30  # the sampled frames as RGB: n * H * W * 3


def sample_indices(total: int, source_fps: float, fps: float = SAMPLE_FPS, min_frames: int = MIN_FRAMES,
                   max_frames: int = MAX_FRAMES, temporal_patch: int = TEMPORAL_PATCH) -> list[int]:
    """The frame indices the rule in the module docstring keeps out of `total` frames."""
    if total < temporal_patch:
        return list(range(total))
    cap = math.floor(min(max_frames, total) / temporal_patch) * temporal_patch
    n = min(max(total / source_fps * fps, min_frames), cap, total)
    n = math.floor(n / temporal_patch) * temporal_patch
    return torch.arange(0, total, total / n).int().tolist()[:n]


def load_video(source: bytes | Path, fps: float = SAMPLE_FPS, max_frames: int = MAX_FRAMES,
               limits: VideoLimits = VideoLimits()) -> tuple[np.ndarray, float]:
    """(frames [T, H, W, 3] uint8, fps of the sampled frames) from an mp4/mov or webm/mkv file.

    Raises `InputError` for empty, oversized, corrupt or unsupported input and for any limit
    exceeded. `fps` and `max_frames` set the sampling rule (defaults: 2 fps, at most 768).
    """
    if not fps > 0 or max_frames < TEMPORAL_PATCH:
        raise InputError(f"video sampling needs fps > 0 and max_frames >= {TEMPORAL_PATCH}, "
                         f"got fps={fps}, max_frames={max_frames}")
    data = _read(source, limits)
    fmt = _container_format(data)
    import av

    try:
        with av.open(io.BytesIO(data), format=fmt) as container:
            stream = _video_stream(container)
            height, width, source_fps = _check_header(container, stream, limits)
            total = _count_frames(container, stream, limits)
            container.seek(0)
            wanted = sample_indices(total, source_fps, fps, max_frames=max_frames)
            if len(wanted) * height * width * 3 > limits.max_kept_bytes:
                raise InputError(f"video of {width}x{height} would keep {len(wanted)} frames "
                                 f"({_size(len(wanted) * height * width * 3)}); the limit is "
                                 f"{_size(limits.max_kept_bytes)}: send a smaller or shorter video")
            frames = _decode(container, stream, wanted, height, width)
    except InputError:
        raise
    except (av.FFmpegError, OSError, ValueError, MemoryError) as e:
        raise InputError(f"video ({len(data)} bytes) is corrupt or cannot be decoded: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return frames, len(wanted) * source_fps / total if total > 1 else source_fps


def _read(source: bytes | Path, limits: VideoLimits) -> bytes:
    if isinstance(source, Path):
        if not source.is_file():
            raise InputError(f"video file not found: {source}")
        if source.stat().st_size > limits.max_bytes:
            raise InputError(f"video file {source} is larger than {_size(limits.max_bytes)}")
        source = source.read_bytes()
    if not isinstance(source, (bytes, bytearray, memoryview)):
        raise InputError(f"a video must be encoded bytes (mp4 or webm), got {type(source).__name__}")
    if len(source) == 0:
        raise InputError("video input is empty (0 bytes)")
    if len(source) > limits.max_bytes:
        raise InputError(f"video input is {_size(len(source))}; the limit is {_size(limits.max_bytes)}")
    return bytes(source)


def _size(n: int) -> str:
    return f"{n} bytes" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


def _container_format(data: bytes) -> str:
    """The ffmpeg demuxer for the magic bytes: mp4/mov or Matroska/webm, nothing else."""
    if data[4:8] in MP4_BOXES:
        return "mp4"
    if data[:4] == EBML_MAGIC:
        return "matroska"
    raise InputError("video is not an mp4/mov or webm/mkv file (unrecognised container)")


def _video_stream(container):
    if not container.streams.video:
        found = ", ".join(s.type for s in container.streams) or "no streams"
        raise InputError(f"video file has no readable video stream (found: {found}); "
                         "it is audio-only, truncated or corrupt")
    stream = container.streams.video[0]
    if stream.codec_context is None or not stream.codec_context.codec.is_decoder:
        raise InputError("video codec is not supported")
    return stream


def _check_header(container, stream, limits: VideoLimits) -> tuple[int, int, float]:
    """(height, width, frames per second) from the header, with the size and duration limits."""
    width, height = int(stream.codec_context.width), int(stream.codec_context.height)
    if width <= 0 or height <= 0:
        raise InputError("video header declares no frame size")
    if width * height > limits.max_frame_pixels:
        raise InputError(f"video frames are {width}x{height}; the limit is {limits.max_frame_pixels} pixels")
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise InputError(f"video aspect ratio {width}x{height} exceeds {MAX_ASPECT_RATIO}:1")
    seconds = _duration(container, stream)
    if seconds is not None and seconds > limits.max_seconds:
        raise InputError(f"video is {seconds:.1f} s long; the limit is {limits.max_seconds:g} s")
    rate = stream.average_rate or stream.guessed_rate
    if rate is None or not 0 < float(rate) <= 1000:
        raise InputError(f"video declares no usable frame rate ({rate})")
    return height, width, float(rate)


def _duration(container, stream) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000  # AV_TIME_BASE
    return None


def _count_frames(container, stream, limits: VideoLimits) -> int:
    """Frames in the file, exactly: one pass over the video packets (demuxed, not decoded)."""
    total = 0
    for packet in container.demux(stream):
        if packet.size:
            total += 1
            if total > limits.max_source_frames:
                raise InputError(f"video has more than {limits.max_source_frames} frames")
    if total == 0:
        raise InputError("video stream holds no frames")
    return total


def _decode(container, stream, wanted: list[int], height: int, width: int) -> np.ndarray:
    """The `wanted` frames (increasing indices) as RGB, into one array allocated up front."""
    out = np.empty((len(wanted), height, width, 3), dtype=np.uint8)  # [T, H, W, 3]
    k = decoded = 0
    for frame in container.decode(stream):
        if decoded == wanted[k]:
            out[k] = frame.to_ndarray(format="rgb24", width=width, height=height)
            k += 1
            if k == len(wanted):
                return out
        decoded += 1
    raise InputError(f"video ended after {decoded} decodable frames of the {wanted[-1] + 1} or more its "
                     "packets promise: the file is truncated or corrupt")
