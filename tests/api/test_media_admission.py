"""Heavy media work cannot starve ordinary requests: voice encoding has its own bounded pool
(--voice-workers, --voice-queue), so a burst of slow voice creations neither delays a speech
request behind them nor makes /health slow, and one more than the pool holds gets 503 with
Retry-After before its body is read. Chat media decoding has its own pool likewise.

The server runs in this process (real HTTP on 127.0.0.1) so the test can see the voice pool and
hold each encoding, after its real work, until the speech request is done: the speech request
provably did not wait behind any of them, however fast or slow the machine."""
from __future__ import annotations

import io
import threading
import time

import httpx
import numpy as np
import pytest
import soundfile as sf
from api_helpers import serving_app, wait_for
from speech_helpers import FISH, FISH_RATE

VOICE_WORKERS, VOICE_QUEUE = 1, 2
SAMPLE_S = 60  # the demo codec takes ~3 s to encode this much audio on CPU: real work beside the speech


@pytest.fixture(scope="module")
def fish(tmp_path_factory):
    """(url, the model, the server's pools): `omnivox serve --model fish-demo --voice-workers 1
    --voice-queue 2`, in this process."""
    import torch

    from omnivox.api.admission import Pools
    from omnivox.api.server import create_app
    from omnivox.api.voices import VoiceStore
    from omnivox import FishTTS
    torch.set_num_threads(1)
    tts = FishTTS(progress=False)
    pools = Pools.create(voice_workers=VOICE_WORKERS, voice_queue=VOICE_QUEUE)
    voices = VoiceStore(tmp_path_factory.mktemp("admission-voices"))
    with serving_app(create_app(tts.served, FISH, voices=voices, pools=pools)) as url:  # its lifespan closes the model
        yield url, tts, pools


def _long_sample(seconds: int, hz: float) -> bytes:
    """A distinct clip per call (the server caches encodings by content)."""
    t = np.arange(seconds * FISH_RATE) / FISH_RATE
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32), FISH_RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def test_voice_creations_do_not_delay_speech(fish, monkeypatch):
    url, tts, pools = fish
    encoding, release = threading.Event(), threading.Event()
    real = tts.encode_voice

    def held(sample, transcript):  # worker thread: the real encoding, then held until the test says
        encoding.set()
        voice = real(sample, transcript)
        release.wait(timeout=300)
        return voice

    monkeypatch.setattr(tts, "encode_voice", held)
    done: dict[str, float] = {}
    statuses: dict[str, int] = {}

    def create(name: str, hz: float) -> None:
        r = httpx.post(url + "/v1/audio/voices", timeout=300,
                       data={"name": name, "consent": "c", "transcript": "a long reference"},
                       files={"audio_sample": ("r.wav", _long_sample(SAMPLE_S, hz), "audio/wav")})
        statuses[name], done[name] = r.status_code, time.monotonic()

    names = [f"slow{i}" for i in range(VOICE_WORKERS + VOICE_QUEUE)]
    threads = [threading.Thread(target=create, args=(n, 200 + 10 * i)) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    try:
        # every upload is in: the worker is busy with an encoding (held: it cannot finish, so no
        # job leaves the pool) and the pool holds one job per creation, as many as it takes
        wait_for(lambda: encoding.is_set() and pools.voice.pending == len(names), timeout=120,
                 what="one encoding running and the other uploads queued")
        # one more than the pool holds: refused at once, before its (large) body is read
        extra = httpx.post(url + "/v1/audio/voices", timeout=30, data={"name": "extra", "consent": "c",
                                                                       "transcript": "t"},
                           files={"audio_sample": ("r.wav", _long_sample(SAMPLE_S, 190), "audio/wav")})
        assert extra.status_code == 503 and extra.headers["retry-after"] == "1", extra.text
        assert "--voice-workers" in extra.json()["error"]["message"]
        start = time.monotonic()
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        assert time.monotonic() - start < 2.0  # at once (~0.04 s quiet), not behind the encodings
        speech = httpx.post(url + "/v1/audio/speech", timeout=120,
                            json={"model": FISH, "input": "Still serving.", "response_format": "pcm",
                                  "max_frames": 5})
        assert speech.status_code == 200 and len(speech.content) > 0
        assert not done and pools.voice.pending == len(names)  # it did not wait behind any voice creation
    finally:
        release.set()
        for t in threads:
            t.join(timeout=300)
    assert all(statuses[n] == 200 for n in names), statuses
    for n in names:
        assert httpx.delete(f"{url}/v1/audio/voices/{n}").status_code == 200
