"""A request that fails after its first bytes is visibly failed to its client, and after an engine
step fails `/health` and `/metrics` say what is true now.

The server runs in this process (real HTTP on 127.0.0.1) on a demo model this module controls:
requests with seed BREAKS get Talker sampling values that no API accepts (as
tests/engine/test_isolation.py does), so the real engine fails them after their first frame, the
way a request fails when its sampling breaks mid-way.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
import numpy as np
import openai
import pytest
from api_helpers import MODEL, metric, pcm16, serving_app

from omnivox.sampling.params import SamplingParams
from omnivox.serving import ChatParams

BREAKS = 666
TEXT = "Hello there, this is a long sentence to voice."
FRAMES = 40


def _unvalidated(**fields) -> SamplingParams:
    p = SamplingParams()
    for k, v in fields.items():
        object.__setattr__(p, k, v)  # past __post_init__: what no API accepts
    return p


@pytest.fixture(scope="module")
def served(demo_cache):
    import torch

    from omnivox.api.server import create_app
    from omnivox import Omni
    torch.set_num_threads(1)
    from omnivox.engine.config import EngineConfig
    # one-frame first chunks: the first frame is sent before the failure (auto may hold it back
    # until the request has failed, which is then a plain 4xx, not a cut stream)
    omni = Omni(model=demo_cache[1], progress=False, engine_config=EngineConfig(first_chunk_frames=1))
    options = omni.options

    def options_that_break_on_seed(params: ChatParams = ChatParams()):
        opts = options(params)
        if params.seed != BREAKS:
            return opts
        return replace(opts, talker=_unvalidated(temperature=0.8, repetition_penalty=1e-40))  # logits -> inf -> NaN

    omni.options = options_that_break_on_seed  # this module's model only
    with serving_app(create_app(omni.served, MODEL)) as url:  # its lifespan closes the model
        yield url, omni


def body(seed: int, fmt: str = "pcm", stream: str | None = "audio") -> dict:
    b = {"model": MODEL, "input": TEXT, "voice": "ethan", "response_format": fmt, "seed": seed, "max_frames": FRAMES}
    return {**b, "stream_format": stream} if stream else b


@pytest.mark.parametrize("fmt", ["pcm", "wav"])
def test_a_raw_audio_stream_that_fails_midway_is_cut(served, fmt):
    url, _ = served
    got = b""
    with httpx.stream("POST", url + "/v1/audio/speech", json=body(BREAKS, fmt), timeout=60) as r:
        assert r.status_code == 200 and r.headers["transfer-encoding"] == "chunked"
        with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
            for chunk in r.iter_raw():
                got += chunk
    audio = got[44:] if fmt == "wav" else got
    assert 0 < len(audio) < FRAMES * 1920 * 2  # the first frame came, then the cut: no clean end
    if fmt == "wav":
        assert got[:4] == b"RIFF"
    text = httpx.get(url + "/metrics").text
    assert metric(text, "omnivox_speech_requests_total", finish_reason="error") >= 1


def test_the_openai_client_sees_the_cut_and_others_finish(served):
    url, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    whole = client.audio.speech.create(model=MODEL, input=TEXT, voice="ethan", response_format="pcm",
                                       extra_body={"seed": 7, "max_frames": 12}).content

    async def both():
        async with httpx.AsyncClient(timeout=60) as http:
            async def good() -> bytes:
                async with http.stream("POST", url + "/v1/audio/speech", json={**body(7), "max_frames": 12}) as r:
                    return b"".join([c async for c in r.aiter_bytes()])

            async def bad() -> BaseException | None:
                try:
                    async with http.stream("POST", url + "/v1/audio/speech", json=body(BREAKS)) as r:
                        async for _ in r.aiter_bytes():
                            pass
                except httpx.HTTPError as e:
                    return e
                return None

            return await asyncio.gather(good(), bad(), bad())

    streamed, *errors = asyncio.run(both())
    assert all(isinstance(e, httpx.RemoteProtocolError) for e in errors), errors
    # the other stream finished with the right audio (batched with the failing ones: within 2 LSB)
    assert len(streamed) == len(whole) > 0 and np.abs(pcm16(streamed) - pcm16(whole)).max() <= 2
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, input=TEXT, voice="ethan", response_format="pcm", stream_format="audio",
            extra_body={"seed": BREAKS, "max_frames": FRAMES}) as r:
        assert r.status_code == 200
        with pytest.raises(Exception, match="incomplete chunked read"):  # the client's own httpx fork raises
            for _ in r.iter_bytes():
                pass


def test_an_sse_stream_that_fails_midway_ends_with_an_error_event(served):
    url, _ = served
    with httpx.stream("POST", url + "/v1/audio/speech", json=body(BREAKS, stream="sse"), timeout=60) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert '"speech.audio.delta"' in events[0] and '"type":"error"' in events[-1], events[-1]


def test_health_is_fresh_after_an_engine_step_fails(served):
    url, omni = served
    engine = omni.engine
    stage = engine.stages.stages["talker"]
    real, calls = stage.step, [0]

    def step_that_fails_once():
        calls[0] += 1
        if calls[0] == 3:  # mid-request: the steps before it published running/waiting/pages
            raise RuntimeError("injected fault: secret detail /srv/omnivox/key")
        return real()

    stage.step = step_that_fails_once
    try:
        r = httpx.post(url + "/v1/audio/speech", json=body(3, stream=None), timeout=60)
    finally:
        del stage.step
    assert r.status_code == 500, r.text
    assert "secret" not in r.text and "see the server log" in r.json()["error"]["message"]
    now = engine.stats()  # published before the failure reached the client: no later step needed
    assert (now.in_flight, now.running, now.waiting) == (0, 0, 0) and now.kv_pages_free == now.kv_pages_total
    h = httpx.get(url + "/health", timeout=5)
    assert h.status_code == 200 and h.json() | {"model": None} == {"status": "healthy", "model": None, "in_flight": 0,
                                                                    "running": 0, "waiting": 0}
    text = httpx.get(url + "/metrics").text
    for s in ("thinker", "talker"):
        assert metric(text, "omnivox_kv_cache_pages_free", stage=s) == metric(text, "omnivox_kv_cache_pages_total",
                                                                               stage=s)
    assert all(metric(text, name, kind=kind) == 0 for name in ("omnivox_requests_running", "omnivox_requests_waiting")
               for kind in ("playing", "batch"))
    ok = httpx.post(url + "/v1/audio/speech", json=body(3, stream=None), timeout=60)
    assert ok.status_code == 200 and len(pcm16(ok.content)) > 0
    assert np.abs(pcm16(ok.content)).max() > 0
