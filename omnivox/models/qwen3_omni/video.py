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
(packets, no decoding); from these the tokens and the memory of decoding are priced and reserved
from the request's `DecodeBudget` (media_budget.py). `load_video_patches` then decodes frame by
frame straight into patches (the full-resolution frames are never all held), the decoder refuses
any frame over `max_frame_pixels` (a frame may not grow past the limit the header was checked
against), a frame of another size than the header's is priced again, frames not kept are never
converted (nor decoded at all for intra-only codecs such as mjpeg), the budget's clock is checked
after every frame, and decoding stops at the last sampled frame. Only the mp4/mov and
Matroska/webm demuxers are ever opened (chosen from the magic bytes), so a payload can never make
ffmpeg read playlists, other files or URLs.
"""
from __future__ import annotations

import io
import math
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from omnivox.errors import InputError
from omnivox.media_budget import DecodeBudget, size as _size
from omnivox.models.qwen3_omni.image_processor import (MAX_ASPECT_RATIO, VisionProcessorConfig, num_vision_tokens,
                                                       patch_bytes, patch_frames, video_grid, video_size, work_bytes)

SAMPLE_FPS = 2.0
MIN_FRAMES, MAX_FRAMES = 4, 768  # Qwen2VLVideoProcessor.min_frames / max_frames
TEMPORAL_PATCH = 2
MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip")  # what an mp4/mov may start with
EBML_MAGIC = b"\x1a\x45\xdf\xa3"  # Matroska / webm
# NOTE: bytes per pixel of one full-resolution frame while it is decoded: the decoder's picture
# (up to 3 for 4:4:4) and the pictures it holds as references, the RGB copy, PIL's RGBX copy
FRAME_BYTES_PER_PIXEL = 16


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


@dataclass(frozen=True)
class Probe:
    """What the header and one demux pass say about a video, before any frame is decoded."""

    height: int
    width: int
    source_fps: float
    total: int  # frames in the file
    wanted: list[int]  # the sampled frame indices, increasing

    @property
    def fps(self) -> float:
        """The rate of the sampled frames."""
        return len(self.wanted) * self.source_fps / self.total if self.total > 1 else self.source_fps

    def describe(self) -> str:
        return f"video of {len(self.wanted)} frames at {self.width}x{self.height}"


def load_video(source: bytes | Path, fps: float = SAMPLE_FPS, max_frames: int = MAX_FRAMES,
               limits: VideoLimits = VideoLimits(), budget: DecodeBudget | None = None) -> tuple[np.ndarray, float]:
    """(frames [T, H, W, 3] uint8, fps of the sampled frames) from an mp4/mov or webm/mkv file.

    Raises `InputError` for empty, oversized, corrupt or unsupported input and for any limit
    exceeded. `fps` and `max_frames` set the sampling rule (defaults: 2 fps, at most 768);
    `budget`: the request's (None: a fresh one of the defaults), charged the kept RGB frames.
    """
    budget = budget if budget is not None else DecodeBudget()
    with _opened(source, limits) as (container, stream):
        probe = _probe(container, stream, limits, fps, max_frames)
        n, height, width = len(probe.wanted), probe.height, probe.width
        if n * height * width * 3 > limits.max_kept_bytes:
            raise InputError(f"video of {width}x{height} would keep {n} frames ({_size(n * height * width * 3)}); "
                             f"the limit is {_size(limits.max_kept_bytes)}: send a smaller or shorter video")
        budget.reserve(probe.describe(), kept=n * height * width * 3,
                       transient=height * width * FRAME_BYTES_PER_PIXEL)
        frames = np.empty((n, height, width, 3), dtype=np.uint8)  # [T, H, W, 3]
        for k, frame in enumerate(_decode(container, stream, probe, limits, budget)):
            frames[k] = frame
    return frames, probe.fps


def load_video_patches(source: bytes | Path, cfg: VisionProcessorConfig, fps: float = SAMPLE_FPS,
                       max_frames: int = MAX_FRAMES, limits: VideoLimits = VideoLimits(),
                       budget: DecodeBudget | None = None) -> tuple[torch.Tensor, tuple[int, int, int], float]:
    """`preprocess_video(*load_video(source))` - (pixel_values, grid, second_per_grid), the same
    values - without ever holding more than one full-resolution frame: each sampled frame is
    resized into its patches as it is decoded. Its tokens and memory (the float32 patches, one
    full-resolution frame, one temporal group at work) are reserved from `budget` before decoding.
    """
    budget = budget if budget is not None else DecodeBudget()
    with _opened(source, limits) as (container, stream):
        probe = _probe(container, stream, limits, fps, max_frames)
        size = video_size(probe.height, probe.width, cfg)
        grid = video_grid(len(probe.wanted), size, cfg)
        work = work_bytes(size, cfg)
        budget.reserve(f"{probe.describe()} (resized to {size[1]}x{size[0]})", kept=patch_bytes(grid, cfg),
                       transient=probe.height * probe.width * FRAME_BYTES_PER_PIXEL + work,
                       tokens=num_vision_tokens(grid, cfg.merge_size))
        frames = _decode(container, stream, probe, limits, budget, work)
        pixel_values = patch_frames(frames, len(probe.wanted), size, cfg)
    return pixel_values, grid, cfg.temporal_patch_size / probe.fps


@contextmanager
def _opened(source: bytes | Path, limits: VideoLimits):
    """(container, first video stream) of a checked file; ffmpeg's errors become InputError."""
    data = _read(source, limits)
    fmt = _container_format(data)
    import av

    try:
        with av.open(io.BytesIO(data), format=fmt) as container:
            stream = _video_stream(container)
            # NOTE: the decoder refuses a frame over the limit before allocating it (a frame may
            # declare another size than the header's: mjpeg frames can grow)
            stream.codec_context.options = {"max_pixels": str(limits.max_frame_pixels)}
            yield container, stream
    except InputError:
        raise
    except (av.FFmpegError, OSError, ValueError, MemoryError) as e:
        raise InputError(f"video ({len(data)} bytes) is corrupt or cannot be decoded: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _probe(container, stream, limits: VideoLimits, fps: float, max_frames: int) -> Probe:
    if not fps > 0 or max_frames < TEMPORAL_PATCH:
        raise InputError(f"video sampling needs fps > 0 and max_frames >= {TEMPORAL_PATCH}, "
                         f"got fps={fps}, max_frames={max_frames}")
    height, width, source_fps = _check_header(container, stream, limits)
    total = _count_frames(container, stream, limits)
    container.seek(0)
    return Probe(height, width, source_fps, total, sample_indices(total, source_fps, fps, max_frames=max_frames))


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


def _decode(container, stream, probe: Probe, limits: VideoLimits, budget: DecodeBudget,
            work: int = 0) -> Iterator[np.ndarray]:
    """The `probe.wanted` frames, in order, as RGB [H, W, 3] uint8 at the header's size. A decoded
    frame of another size is priced again (with `work`: the bytes its preprocessing holds)."""
    wanted, k, seen = probe.wanted, 0, 0
    for index, frame in _decoded(container, stream, set(wanted), limits):
        budget.tick("the video")
        seen = index + 1
        if (frame.width, frame.height) != (probe.width, probe.height):
            budget.check(f"video frame {index} of {frame.width}x{frame.height} (its header says "
                         f"{probe.width}x{probe.height})", frame.width * frame.height * FRAME_BYTES_PER_PIXEL + work)
        if index == wanted[k]:
            yield frame.to_ndarray(format="rgb24", width=probe.width, height=probe.height)
            k += 1
            if k == len(wanted):
                return
    raise InputError(f"video ended after {seen} decodable frames of the {wanted[-1] + 1} or more its "
                     "packets promise: the file is truncated or corrupt")


def _decoded(container, stream, wanted: set[int], limits: VideoLimits):
    """(index, frame) for the frames decoded, in order. NOTE: for an intra-only codec (mjpeg, ...)
    a packet is one whole frame, so only the packets of `wanted` frames are decoded."""
    import av

    try:
        if not stream.codec_context.codec.intra_only:
            yield from enumerate(container.decode(stream))
            return
        sent, index = deque(), 0
        for packet in container.demux(stream):
            if packet.size:
                index += 1
                if index - 1 not in wanted:
                    continue
                sent.append(index - 1)
            for frame in packet.decode():
                if sent:
                    yield sent.popleft(), frame
    except av.error.ArgumentError:  # EINVAL: what the decoder's max_pixels raises
        raise InputError(f"a video frame cannot be decoded: its size is invalid or larger than the limit of "
                         f"{limits.max_frame_pixels} pixels (a frame may not grow past the limit)") from None
