"""Heavy media work cannot starve ordinary requests: voice encoding has its own bounded pool
(--voice-workers, --voice-queue), so a burst of slow voice creations neither delays a speech
request behind them nor makes /health slow, and one more than the pool holds gets 503 with
Retry-After before its body is read. Chat media decoding has its own pool likewise."""
from __future__ import annotations

import io
import threading
import time

import httpx
import numpy as np
import pytest
import soundfile as sf
from api_helpers import running_server
from speech_helpers import FISH, FISH_RATE

VOICE_WORKERS, VOICE_QUEUE = 1, 2
SAMPLE_S = 60  # the demo codec takes ~3 s to encode this much audio on CPU (20 s took ~0.9 s: too little)


@pytest.fixture(scope="module")
def fish(demo_cache, tmp_path_factory):
    folder = tmp_path_factory.mktemp("admission-voices")
    with running_server(demo_cache[0], "--model", "fish-demo", "--voices-dir", str(folder), "--voice-workers",
                        str(VOICE_WORKERS), "--voice-queue", str(VOICE_QUEUE)) as (url, _, _):
        yield url


def _long_sample(seconds: int, hz: float) -> bytes:
    """A distinct clip per call (the server caches encodings by content)."""
    t = np.arange(seconds * FISH_RATE) / FISH_RATE
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32), FISH_RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def test_voice_creations_do_not_delay_speech(fish):
    done: dict[str, float] = {}
    statuses: dict[str, int] = {}

    def create(name: str, hz: float) -> None:
        r = httpx.post(fish + "/v1/audio/voices", timeout=300,
                       data={"name": name, "consent": "c", "transcript": "a long reference"},
                       files={"audio_sample": ("r.wav", _long_sample(SAMPLE_S, hz), "audio/wav")})
        statuses[name], done[name] = r.status_code, time.monotonic()

    names = [f"slow{i}" for i in range(VOICE_WORKERS + VOICE_QUEUE)]
    threads = [threading.Thread(target=create, args=(n, 200 + 10 * i)) for i, n in enumerate(names)]
    for t in threads:
        t.start()
        time.sleep(0.2)  # in order: the first one is encoding when the others queue
    time.sleep(1.0)  # every upload is in: one encoding, the others queued
    # one more than the pool holds: refused at once, before its (large) body is read
    extra = httpx.post(fish + "/v1/audio/voices", timeout=30, data={"name": "extra", "consent": "c",
                                                                     "transcript": "t"},
                       files={"audio_sample": ("r.wav", _long_sample(SAMPLE_S, 190), "audio/wav")})
    assert extra.status_code == 503 and extra.headers["retry-after"] == "1", extra.text
    assert "--voice-workers" in extra.json()["error"]["message"]
    start = time.monotonic()
    assert httpx.get(fish + "/health", timeout=5).status_code == 200
    assert time.monotonic() - start < 1.0
    speech = httpx.post(fish + "/v1/audio/speech", timeout=120,
                        json={"model": FISH, "input": "Still serving.", "response_format": "pcm", "max_frames": 5})
    spoke = time.monotonic()
    assert speech.status_code == 200 and len(speech.content) > 0
    for t in threads:
        t.join()
    assert all(statuses[n] == 200 for n in names), statuses
    assert spoke < min(done.values()), (spoke, done)  # it did not wait behind any voice creation
    for n in names:
        assert httpx.delete(f"{fish}/v1/audio/voices/{n}").status_code == 200
