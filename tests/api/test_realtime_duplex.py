"""`/v1/realtime` on a full-duplex model (the moshi demo, `api/realtime/duplex.py`), served in this
process with a short maximum session length: the official `openai` client (3.57.0) holds a session
whose audio equals `Duplex.converse` (greedy) within pcm16 rounding and whose transcript deltas join
to converse's text; turn-based events, turn detection and a bad sampling value are each answered with
one `error` event and the session streams on; the beta dialect's names; the maximum length's end; the
idle close only once every frame sent has its answer; the drain's cut (an `error`, then close 1012)."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest
import websockets

from omnivox.api.realtime import RealtimeLimits
from omnivox.audio.io import encode_pcm16, load_audio
from realtime_helpers import b64, events_until, live_server, of_type, pieces, recv_until, reply_audio, ws_url

NAME = "omnivox-demo-moshi"
F = 1920  # samples of one frame (80 ms at 24 kHz)
MAX_S = 3.2  # the server's duplex_max_session_s: 40 frames of input
IDLE_S = 2.0  # the server's --realtime-idle-timeout-s
SPEECH = load_audio(Path(__file__).resolve().parents[1] / "media" / "question_24k.wav", target_sr=24000)
PCM = (np.clip(SPEECH[:30 * F], -1, 1) * 32767).round().astype(np.int16)  # 30 whole frames


@pytest.fixture(scope="module")
def duplex():
    """Under fifo: admission by frame deadline (slack) depends on how fast this machine is now, and is
    tested on a clock of its own (tests/engine/test_duplex_engine.py); its refusal, forced, below."""
    from omnivox import Duplex
    d = Duplex(model="moshi-demo")
    engine = d.served.engine
    with engine._lock:  # no request yet: the engine thread reads no policy
        engine.stages.set_scheduling("fifo")
    yield d
    d.close()


@pytest.fixture(scope="module")
def server(duplex):
    with live_server(duplex.served, NAME, realtime=RealtimeLimits(duplex_max_session_s=MAX_S,
                                                                               idle_timeout_s=IDLE_S)) as (url, app):
        yield url, app


def connect(url: str):
    from openai import AsyncOpenAI
    return AsyncOpenAI(base_url=url + "/v1", api_key="none").realtime.connect(model=NAME)


async def deltas(conn, n: int, into: list) -> list:
    """Events until `n` audio deltas in all have arrived (the session itself never ends first)."""
    while len(of_type(into, "response.output_audio.delta")) < n:
        await events_until(conn, "response.output_audio.delta", timeout=60, into=into)
    return into


def test_official_client_holds_a_duplex_session(server, duplex):
    url, app = server
    hub = app.state.realtime
    frames_before, seconds_before = hub.frames.frames.values[()], hub.metrics.input_seconds.values[()]

    async def run():
        async with connect(url) as conn:
            events = await events_until(conn, "response.content_part.added")
            await conn.session.update(session={"type": "realtime", "omnivox": {"greedy": True}})
            for p in pieces(PCM, seed=4, lo_ms=10, hi_ms=130):
                await conn.input_audio_buffer.append(audio=b64(p))
            await conn.input_audio_buffer.append(audio=b64(np.zeros(F, np.int16)))  # its answer ends frame 29's
            return await deltas(conn, 30, events)

    events = asyncio.run(run())
    events = events[:events.index(of_type(events, "response.output_audio.delta")[-1])]  # PCM's answer
    kinds = [e.type for e in events]
    assert kinds[:5] == ["session.created", "response.created", "response.output_item.added",
                         "conversation.item.added", "response.content_part.added"]
    session = events[0].session
    ext = session.model_extra["omnivox"]
    assert ext["duplex"] is True and ext["frame_samples"] == F and ext["max_session_s"] == MAX_S
    want = duplex.served.default_params  # the values in effect: the checkpoint's, unless set
    assert (ext["temperature"], ext["top_k"], ext["text_temperature"], ext["text_top_k"]) == \
        (want.temp, want.top_k, want.temp_text, want.top_k_text) and None not in (want.temp, want.top_k)
    assert session.audio.input.turn_detection is None and session.audio.input.format.rate == 24000
    assert of_type(events, "session.updated")[0].session.model_extra["omnivox"]["greedy"] is True
    assert events[1].response.status == "in_progress"

    want = duplex.converse(PCM.astype(np.float32) / 32768.0, greedy=True)
    assert want.frames == 29  # one frame per input frame but the first
    audio = of_type(events, "response.output_audio.delta")
    assert len(audio) == 29 and all(len(e.delta) == len(b64(np.zeros(F, np.int16))) for e in audio)
    ref = np.frombuffer(encode_pcm16(want.audio), dtype="<i2").astype(np.int32)
    got = reply_audio(events)
    assert got.size == ref.size and np.abs(got - ref).max() <= 1
    transcript = "".join(e.delta for e in of_type(events, "response.output_audio_transcript.delta"))
    assert transcript == want.text and transcript
    response_id = events[1].response.id
    assert {e.response_id for e in audio} == {response_id}
    assert hub.frames.frames.values[()] - frames_before == 30  # each frame observed (api/duplex_frames)
    assert hub.metrics.input_seconds.values[()] - seconds_before == pytest.approx(31 * F / 24000)


@pytest.mark.parametrize("event, code, param", [
    ({"type": "response.create"}, "duplex_session", None),
    ({"type": "input_audio_buffer.commit"}, "duplex_session", None),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                   "content": [{"type": "input_text", "text": "hi"}]}},
     "duplex_session", None),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
        "turn_detection": {"type": "server_vad"}}}}}, "duplex_session", "session.audio.input.turn_detection"),
    ({"type": "session.update", "session": {"type": "realtime", "omnivox": {"greedy": True, "text_top_k": -3}}},
     "invalid_value", "session.omnivox.text_top_k"),
])
def test_what_a_duplex_session_refuses_is_one_error_and_it_streams_on(server, event, code, param):
    url, _ = server

    async def run():
        async with websockets.connect(ws_url(url, NAME), max_size=None) as ws:
            await recv_until(ws, "response.content_part.added")
            await ws.send(json.dumps(event))
            errors = [e for e in await recv_until(ws, "error") if e["type"] == "error"]
            for p in pieces(PCM[:4 * F], seed=1):
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(p)}))
            got = []
            while len([e for e in got if e["type"] == "response.output_audio.delta"]) < 3:
                await recv_until(ws, "response.output_audio.delta", into=got)
            return errors, got

    errors, after = asyncio.run(run())
    assert len(errors) == 1 and errors[0]["error"]["code"] == code and errors[0]["error"]["param"] == param
    assert not [e for e in after if e["type"] in ("error", "session.updated")]  # nothing more, nothing applied


def test_beta_dialect_names(server):
    url, _ = server

    async def run():
        async with websockets.connect(ws_url(url, NAME), max_size=None,
                                      additional_headers={"OpenAI-Beta": "realtime=v1"}) as ws:
            got = await recv_until(ws, "response.content_part.added")
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(PCM[:3 * F])}))
            return await recv_until(ws, "response.audio.delta", into=got)

    kinds = [e["type"] for e in asyncio.run(run())]
    assert kinds[:6] == ["session.created", "conversation.created", "response.created", "response.output_item.added",
                         "conversation.item.created", "response.content_part.added"]
    assert kinds[-1] == "response.audio.delta"


def test_maximum_length_ends_the_response_then_session_expired_and_1001(server):
    """As OpenAI's Realtime API ends a session at its maximum duration (an `error` event
    `session_expired`, then close 1001), after the response's own end."""
    url, _ = server
    over = np.tile(PCM, 2)[:45 * F]  # past the 40 frames of MAX_S

    async def run():
        async with websockets.connect(ws_url(url, NAME), max_size=None) as ws:
            await recv_until(ws, "response.content_part.added")
            for p in pieces(over, seed=2, lo_ms=80, hi_ms=400):
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(p)}))
            got = await recv_until(ws, "response.done")
            after = await recv_until(ws, "error")  # the response's end comes first
            with pytest.raises(websockets.ConnectionClosedOK):
                await asyncio.wait_for(ws.recv(), 30)
            return got, after, ws.close_code, ws.close_reason

    got, after, code, reason = asyncio.run(run())
    expired = after[-1]
    kinds = [e["type"] for e in got]
    assert kinds[-6:] == ["response.output_audio.done", "response.output_audio_transcript.done",
                          "response.content_part.done", "response.output_item.done", "conversation.item.done",
                          "response.done"]
    assert kinds.count("response.output_audio.delta") == 39  # 40 frames in, the first never answered
    done = got[-1]["response"]
    assert done["status"] == "incomplete" and done["status_details"]["omnivox"]["limit"] == "session"
    assert len(after) == 1 and expired["error"]["code"] == "session_expired"
    assert expired["error"]["type"] == "invalid_request_error" and "maximum length" in expired["error"]["message"]
    assert code == 1001 and reason == expired["error"]["message"]


def test_idle_close_waits_for_the_answers(server):
    url, _ = server

    async def run():
        async with websockets.connect(ws_url(url, NAME), max_size=None) as ws:
            await recv_until(ws, "response.content_part.added")
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(PCM[:5 * F])}))
            got = await recv_until(ws, "error", timeout=30)
            with pytest.raises(websockets.ConnectionClosedOK):
                await asyncio.wait_for(ws.recv(), 30)
            return got, ws.close_code

    got, code = asyncio.run(run())
    assert [e["type"] for e in got].count("response.output_audio.delta") == 4  # every frame answered first
    assert got[-1]["error"]["code"] == "idle_timeout" and code == 1000


def test_drain_cut_is_an_error_then_close_1012(server):
    """At the drain's timeout (`RealtimeHub.cut`): an `error` event, code `draining`, then close 1012."""
    url, app = server
    hub = app.state.realtime

    async def run():
        async with websockets.connect(ws_url(url, NAME), max_size=None) as ws:
            await recv_until(ws, "response.content_part.added")
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(PCM[:3 * F])}))
            got = await recv_until(ws, "response.output_audio.delta")
            assert next(iter(hub.sessions.values())).working
            session = next(iter(hub.sessions.values()))
            session.loop.call_soon_threadsafe(hub.cut, "server restarting: the drain's timeout passed")
            got = await recv_until(ws, "error", into=got)
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 30)
            return got, ws.close_code

    got, code = asyncio.run(run())
    assert got[-1]["error"]["code"] == "draining" and code == 1012
    assert "response.done" not in [e["type"] for e in got]


def test_a_session_the_engine_cannot_hold_in_time_is_closed_1013(server, monkeypatch):
    """When the engine's admission by frame deadline refuses one more live session (here: the policy's
    answer forced), the connection is accepted and closed with 1013 and the reason, before any event;
    the next one, admitted again, opens."""
    url, app = server
    engine = app.state.realtime.model.engine
    monkeypatch.setattr(engine.stages.scheduling, "admits_live", lambda live: False)

    async def refused():
        async with websockets.connect(ws_url(url, NAME), max_size=None) as ws:
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 30)
            return ws.close_code, ws.close_reason

    code, reason = asyncio.run(refused())
    assert code == 1013 and "live sessions" in reason, (code, reason)
    monkeypatch.undo()

    async def admitted():
        async with websockets.connect(ws_url(url, NAME), max_size=None) as ws:
            return (await recv_until(ws, "response.created"))[0]["type"]

    assert asyncio.run(admitted()) == "session.created"
    deadline = time.monotonic() + 30  # the admitted one ends with its socket; the refused one left nothing
    while engine.stats().in_flight or engine._live:
        assert time.monotonic() < deadline, (engine.stats().in_flight, engine._live)
        time.sleep(0.02)
