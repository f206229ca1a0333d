"""Small media the tests make: a video whose frames say their index; an mjpeg stream of given packets."""
from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np


def pattern(i: int, h: int, w: int) -> np.ndarray:
    """Frame i: the top half grey at level 8 * i (the index, in luma: it survives lossy coding),
    the bottom half a fixed green | blue split."""
    img = np.zeros((h, w, 3), np.uint8)
    img[: h // 2] = (8 * i) % 256
    img[h // 2:, : w // 2, 1] = 200
    img[h // 2:, w // 2:, 2] = 200
    return img


def still(color: tuple[int, int, int]):
    """A `make_video` frame function: every frame the same flat colour (lossy coding keeps it exact)."""
    return lambda i, h, w: np.full((h, w, 3), color, np.uint8)


def make_video(fmt: str = "mp4", codec: str = "libx264", frames: int = 30, fps: int = 10, w: int = 64,
               h: int = 48, audio: bool = True, frame=pattern) -> bytes:
    """A small video of `frame(i, h, w)` frames (with a silent audio track unless audio=False)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        v = c.add_stream(codec, rate=fps)
        v.width, v.height, v.pix_fmt = w, h, "yuv420p"
        a = None
        if audio:
            a = c.add_stream("libopus" if fmt == "webm" else "aac", rate=48000)
            a.layout = "mono"
        for i in range(frames):
            for p in v.encode(av.VideoFrame.from_ndarray(frame(i, h, w), format="rgb24")):
                c.mux(p)
            if a is not None:
                af = av.AudioFrame.from_ndarray(np.zeros((1, 48000 // fps), np.float32),
                                                format="flt" if fmt == "webm" else "fltp", layout="mono")
                af.sample_rate, af.pts = 48000, i * (48000 // fps)
                for p in a.encode(af):
                    c.mux(p)
        for s in (v, a) if a is not None else (v,):
            for p in s.encode(None):
                c.mux(p)
    return buf.getvalue()


def mjpeg(frames: list[bytes], w: int = 64, h: int = 64, fps: int = 10) -> bytes:
    """A Matroska mjpeg stream whose header says w x h, holding these JPEG packets as they are
    (frames may differ from the header: hostile input)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as c:
        s = c.add_stream("mjpeg", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuvj420p"
        for i, data in enumerate(frames):
            p = av.Packet(data)
            p.stream, p.pts, p.dts, p.time_base = s, i, i, Fraction(1, fps)
            c.mux(p)
    return buf.getvalue()
