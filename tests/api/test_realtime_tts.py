"""Realtime sessions on a text-to-speech model (the Fish S2 demo): text items in, speech out (the
model's 44.1 kHz resampled to the protocol's 24 kHz pcm16), equal to `speech()` with the same
seed; audio input is answered with an `error` event and the session goes on."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from omnivox.audio.io import encode_pcm16
from omnivox.audio.input_stream import StreamResampler
from omnivox import FishTTS
from omnivox.serving import SpeechParams
from realtime_helpers import b64, events_until, live_server, of_type, reply_audio

NAME = "omnivox-demo-fish-s2"
TEXT = "Hello from the realtime route."


@pytest.fixture(scope="module")
def tts():
    torch.set_num_threads(1)
    t = FishTTS(progress=False)
    yield t
    t.close()


def test_text_items_are_spoken_and_audio_input_is_refused(tts):
    async def run(url):
        from openai import AsyncOpenAI
        client = AsyncOpenAI(base_url=url + "/v1", api_key="none")
        async with client.realtime.connect(model=NAME) as conn:
            created = await events_until(conn, "session.created")
            await conn.input_audio_buffer.append(audio=b64(np.zeros(2400, np.int16)))
            refused = await events_until(conn, "error")
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": TEXT}]})
            await conn.response.create(response={"omnivox": {"seed": 7, "max_audio_frames": 30}})
            return created, refused, await events_until(conn, "response.done")

    with live_server(tts, NAME) as (url, app):
        created, refused, events = asyncio.run(run(url))
    session = created[0].session
    assert session.audio.input.turn_detection is None and session.model_extra["omnivox"]["listens"] is False
    assert refused[-1].error.code == "audio_input_unsupported"
    done = of_type(events, "response.done")[0].response
    assert done.status in ("completed", "incomplete")  # the demo's random weights may run to the frame limit
    transcript = "".join(e.delta for e in of_type(events, "response.output_audio_transcript.delta"))
    assert transcript == TEXT == done.output[0].content[0].transcript
    _, samples = tts.speech(TEXT, SpeechParams(seed=7, max_frames=30)).collect()
    r = StreamResampler(tts.sample_rate, 24000)
    ref = np.frombuffer(encode_pcm16(np.concatenate([r.push(samples), r.flush()])), dtype="<i2").astype(np.int32)
    got = reply_audio(events)
    assert got.size == ref.size > 0
    assert np.abs(got - ref).max() <= 1
