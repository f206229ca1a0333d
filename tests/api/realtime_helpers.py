"""Helpers of the realtime tests: a real server on loopback in this process (so a test can also
look at the engine and the session it drives), speech + silence as 24 kHz pcm16, and event
collection with the official `openai` client."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import threading
import time
from pathlib import Path

import numpy as np
import uvicorn

from omnivox.audio.io import load_audio, resample
from omnivox.serve import REALTIME_MAX_MESSAGE
from api_helpers import wait_for  # noqa: F401  (the realtime tests import it from here)

ROOT = Path(__file__).resolve().parents[2]
MEDIA = ROOT / "tests" / "media"
MODEL = "omnivox-demo-qwen3-omni"
RATE = 24000


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(model, served_name: str = MODEL, uvicorn_kw: dict | None = None, **app_kw):
    """`create_app` served by uvicorn on 127.0.0.1 in a thread: yields (http base url, app). `model`:
    a served model, or the offline API over one (`Omni`, `FishTTS`: its `served` is served)."""
    from omnivox.api.server import create_app

    app = create_app(getattr(model, "served", model), served_name, **app_kw)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           ws="websockets-sansio", ws_max_size=REALTIME_MAX_MESSAGE,
                                           **(uvicorn_kw or {})))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def ws_url(url: str, model: str = MODEL) -> str:
    """The `/v1/realtime` URL of a server at http `url`."""
    return url.replace("http", "ws", 1) + f"/v1/realtime?model={model}"


async def recv_until(ws, *kinds: str, timeout: float = 60.0, into: list | None = None) -> list[dict]:
    """Raw server events (JSON) from a `websockets` connection up to and including the first of
    one of `kinds`; each waited for at most `timeout` s."""
    got = [] if into is None else into
    while True:
        got.append(json.loads(await asyncio.wait_for(ws.recv(), timeout)))
        if got[-1]["type"] in kinds:
            return got


def speech_pcm(lead_ms: int = 1000, tail_ms: int = 1500, clip: str = "speech_16k.wav") -> np.ndarray:
    """The committed espeak-ng speech with silence around it (and a little noise: a quiet room), as
    24 kHz int16 samples."""
    wave = load_audio(MEDIA / clip)
    x = np.concatenate([np.zeros(16 * lead_ms, np.float32), wave, np.zeros(16 * tail_ms, np.float32)])
    x = x + (1e-3 * np.random.default_rng(0).standard_normal(len(x))).astype(np.float32)
    return (np.clip(resample(x, 16000, RATE), -1, 1) * 32767).round().astype(np.int16)


def pieces(pcm: np.ndarray, seed: int = 0, lo_ms: int = 20, hi_ms: int = 100) -> list[np.ndarray]:
    """pcm cut into pieces of 20-100 ms (seeded)."""
    rng, out, i = np.random.default_rng(seed), [], 0
    while i < len(pcm):
        n = int(rng.integers(lo_ms, hi_ms + 1)) * RATE // 1000
        out.append(pcm[i:i + n])
        i += n
    return out


def b64(pcm: np.ndarray) -> str:
    return base64.b64encode(pcm.astype("<i2").tobytes()).decode()


def pcm_of(delta: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(delta), dtype="<i2").astype(np.int32)


async def events_until(conn, stop: str, timeout: float = 120.0, into: list | None = None) -> list:
    """Server events (parsed by the client) up to and including the first of type `stop`."""
    got = [] if into is None else into
    async def collect():
        async for ev in conn:
            got.append(ev)
            if ev.type == stop:
                return
    await asyncio.wait_for(collect(), timeout)
    return got


def of_type(events: list, kind: str) -> list:
    return [e for e in events if e.type == kind]


def reply_audio(events: list) -> np.ndarray:
    deltas = [pcm_of(e.delta) for e in of_type(events, "response.output_audio.delta")]
    return np.concatenate(deltas) if deltas else np.zeros(0, np.int32)
