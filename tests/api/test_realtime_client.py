"""`/v1/realtime` with the official `openai` client (3.57.0, `client.realtime.connect`) against a real
server on loopback: server VAD, manual turns, a two-turn conversation on the prefix cache,
barge-in with truncation, bad client events, the beta dialect, 16 sessions at once."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest
import websockets

from omnivox.audio.input_stream import turn_features
from omnivox.audio.io import encode_pcm16
from omnivox.audio.mel import num_audio_tokens
from omnivox.models.qwen3_omni.types import AudioFeatures
from realtime_helpers import (MODEL, b64, events_until, live_server, of_type, pcm_of, pieces, reply_audio,
                              speech_pcm, wait_for)
from test_realtime_equality import conversation_ids

GREEDY = {"greedy": True}


@pytest.fixture(scope="module")
def server(omni):
    with live_server(omni) as (url, app):
        yield url, app


def connect(url: str, **kw):
    from openai import AsyncOpenAI
    return AsyncOpenAI(base_url=url + "/v1", api_key="none").realtime.connect(model=MODEL, **kw)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def speak(conn, pcm, seed=0):
    for p in pieces(pcm, seed):
        await conn.input_audio_buffer.append(audio=b64(p))


def test_server_vad_turn_gets_a_spoken_reply(server):
    url, app = server
    ttfa_before = metric(url, "omnivox_realtime_time_to_first_audio_seconds_count")

    async def run():
        async with connect(url) as conn:
            await conn.session.update(session={"type": "realtime", "max_output_tokens": 6,
                                               "audio": {"output": {"voice": "aiden"}},
                                               "omnivox": {"max_audio_frames": 10}})
            await speak(conn, speech_pcm(), seed=3)
            return await events_until(conn, "response.done")

    events = asyncio.run(run())
    kinds = [e.type for e in events]
    assert kinds[0] == "session.created" and "session.updated" in kinds
    started, stopped = of_type(events, "input_audio_buffer.speech_started"), of_type(events, "input_audio_buffer.speech_stopped")
    assert len(started) == len(stopped) == 1
    assert 600 <= started[0].audio_start_ms <= 800  # the speech begins at 1000 ms; 300 ms of padding
    assert 3500 <= stopped[0].audio_end_ms <= 4100  # it ends at ~3530 ms; 500 ms of silence
    assert stopped[0].item_id == started[0].item_id == of_type(events, "input_audio_buffer.committed")[0].item_id
    order = ["input_audio_buffer.speech_stopped", "input_audio_buffer.committed", "response.created",
             "response.output_item.added", "response.content_part.added", "response.output_audio.delta",
             "response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
             "response.output_item.done", "response.done"]
    assert [k for k in kinds if k in order] == sorted((k for k in kinds if k in order), key=order.index)
    assert len(of_type(events, "response.output_audio_transcript.delta")) > 0
    audio = reply_audio(events)
    done = of_type(events, "response.done")[0].response
    assert done.status == "incomplete" and done.status_details.reason == "max_output_tokens"
    assert done.usage.output_token_details.text_tokens == 6
    assert done.audio.output.voice == "aiden"
    assert done.model_extra["omnivox"]["audio_ms"] == audio.size // 24 > 0
    transcript = "".join(e.delta for e in of_type(events, "response.output_audio_transcript.delta"))
    assert of_type(events, "response.output_audio_transcript.done")[0].transcript == transcript
    assert done.output[0].content[0].transcript == transcript
    assert metric(url, "omnivox_realtime_time_to_first_audio_seconds_count") == ttfa_before + 1


def test_manual_turns_commit_then_response_create(server, omni):
    url, app = server

    async def run():
        async with connect(url) as conn:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                               "audio": {"input": {"turn_detection": None}}, "max_output_tokens": 5,
                                               "omnivox": {**GREEDY, "audio_window_s": 3}})
            updated = await events_until(conn, "session.updated")
            pcm = speech_pcm(lead_ms=200, tail_ms=200)
            await speak(conn, pcm, seed=5)
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            events = await events_until(conn, "response.done")
            return pcm, updated, events

    pcm, updated, events = asyncio.run(run())
    ext = updated[-1].session.model_extra["omnivox"]
    assert (ext["audio_window_s"], ext["audio_window_chunks"]) == (3, 3)  # the AuT window, reported
    assert not of_type(events, "input_audio_buffer.speech_started")  # no VAD: the client decides
    committed = of_type(events, "input_audio_buffer.committed")
    assert len(committed) == 1 and committed[0].previous_item_id is None
    text = "".join(e.delta for e in of_type(events, "response.output_text.delta"))
    assert not of_type(events, "response.output_audio.delta")
    assert of_type(events, "response.output_text.done")[0].text == text
    feats, _ = turn_features(pcm)
    want = omni.generate(prompt_ids=conversation_ids(omni, [(num_audio_tokens(feats.shape[1]), None)]),
                         audio=[AudioFeatures(feats, 3)], greedy=True, max_tokens=5, return_audio=False)
    assert text == want.text
    assert of_type(events, "response.done")[0].response.output[0].content[0].text == want.text


INSTRUCTIONS = "Answer in one short sentence."


def two_turns(url, engine, modalities: list[str]):
    """Two spoken turns (server VAD); the prefix-cache hits of the second: (first events, hit tokens,
    second events)."""
    async def run():
        async with connect(url) as conn:
            await conn.session.update(session={"type": "realtime", "max_output_tokens": 20,
                                               "instructions": INSTRUCTIONS, "output_modalities": modalities,
                                               "omnivox": {**GREEDY, "max_audio_frames": 4}})
            await speak(conn, speech_pcm(tail_ms=800), seed=1)
            first = await events_until(conn, "response.done")
            hits = engine.stats().prefix_hit_tokens
            await speak(conn, speech_pcm(lead_ms=300, tail_ms=800, clip="speech_22k.flac"), seed=2)
            second = await events_until(conn, "response.done")
            return first, engine.stats().prefix_hit_tokens - hits, second
    return asyncio.run(run())


def test_second_turn_reuses_the_first_turns_kv(server, omni):
    """Turn 2's prompt repeats turn 1 (the instructions, its rows with the same keys, its reply as
    generated ids): the prefix cache serves every full block of it, the reply included."""
    url, app = server
    first, hit, second = two_turns(url, omni.engine, ["text"])
    r1 = of_type(first, "response.done")[0].response
    p1, n1 = r1.usage.input_tokens, r1.usage.output_token_details.text_tokens
    system = sum(len(omni.tokenizer.encode(t)) for t in ("<|im_start|>system\n", INSTRUCTIONS, "<|im_end|>\n"))
    assert p1 == system + 10 + r1.usage.input_token_details.audio_tokens  # the instructions persist...
    r2 = of_type(second, "response.done")[0].response
    assert r2.usage.input_tokens > p1 + n1  # ... and turn 2 holds all of turn 1
    block = omni.engine_config.block_size
    assert hit == (p1 + n1 - 1) // block * block  # every computed full block of turn 1
    assert hit > p1  # ... its reply included
    assert metric(url, "omnivox_prefix_cache_hit_tokens_total") >= hit


def test_second_spoken_turn_reuses_the_first_turns_kv(server, omni):
    """The same with spoken replies: the block that turn 1's prompt end cuts (its last audio rows,
    then the reply's first tokens) is reused too (its Talker input rows were kept)."""
    url, app = server
    first, hit, second = two_turns(url, omni.engine, ["audio"])
    r1 = of_type(first, "response.done")[0].response
    p1, n1 = r1.usage.input_tokens, r1.usage.output_token_details.text_tokens
    block = omni.engine_config.block_size
    rows_end = p1 - 6  # the last audio row's position + 1: the end of the user turn and the assistant header follow
    assert (rows_end - 1) // block == (p1 - 1) // block  # this turn's last audio block straddles the prompt's end
    assert hit == (p1 + n1 - 1) // block * block


def test_barge_in_cancels_and_truncate_keeps_what_was_heard(server, omni):
    """Speech during a reply cancels it (response.done cancelled / turn_detected); the client
    truncates the reply to what it played; the next reply equals Omni.generate on a conversation
    whose first reply is only the ids whose text was heard."""
    url, app = server
    hub = app.state.realtime
    barge_before = metric(url, "omnivox_realtime_barge_ins_total")
    pcm1 = speech_pcm(tail_ms=800)
    pcm2 = speech_pcm(lead_ms=300, tail_ms=800, clip="speech_22k.flac")
    half = len(pcm2) // 2

    async def run():
        async with connect(url) as conn:
            await conn.session.update(session={"type": "realtime", "max_output_tokens": 200,
                                               "omnivox": {**GREEDY, "max_audio_frames": 400}})
            await speak(conn, pcm1, seed=1)
            events = []
            for _ in range(8):  # the reply is under way
                await events_until(conn, "response.output_audio.delta", into=events)
            await speak(conn, pcm2[:half], seed=4)  # the user talks over it
            await events_until(conn, "input_audio_buffer.speech_started", into=events)
            await events_until(conn, "response.done", into=events)
            in_flight = omni.engine.stats().in_flight  # the cancelled reply is gone (turn 2's may be open)
            played_ms = sum(pcm_of(e.delta).size for e in of_type(events, "response.output_audio.delta")[:6]) // 24
            reply = of_type(events, "response.output_item.added")[0].item.id
            await conn.conversation.item.truncate(item_id=reply, content_index=0, audio_end_ms=played_ms)
            await conn.session.update(session={"type": "realtime", "max_output_tokens": 8,
                                               "omnivox": {**GREEDY, "max_audio_frames": 12}})
            later = await events_until(conn, "session.updated")
            await speak(conn, pcm2[half:], seed=5)
            later = await events_until(conn, "response.done", into=later)
            live = hub.sessions[events[0].session.id]  # this one: an earlier test's may still be closing
            return events, later, played_ms, list(live.conversation.items), in_flight

    events, later, played_ms, items, in_flight = asyncio.run(run())
    assert in_flight <= 1
    done = of_type(events, "response.done")[0].response
    assert done.status == "cancelled" and done.status_details.reason == "turn_detected"
    assert metric(url, "omnivox_realtime_barge_ins_total") == barge_before + 1
    assert of_type(later, "conversation.item.truncated")[0].audio_end_ms == played_ms
    user1, reply1, user2, reply2 = items
    heard = "".join(e.delta for e in transcript_of_played(events, played_ms))
    full = done.output[0].content[0].transcript
    assert heard and len(heard) < len(full) and full.startswith(heard)
    assert reply1.transcript == heard and reply1.status == "incomplete"
    ids = conversation_ids(omni, [(user1.n_rows, reply1.ids), (user2.n_rows, None)])
    f1, peak = turn_features(pcm1[ms(events, "speech_started", 0) * 24:ms(events, "speech_stopped", 0) * 24])
    offset = len(pcm1)  # turn 2's audio times count from the session's start
    start2 = ms(events, "speech_started", 1) * 24 - offset
    stop2 = of_type(later, "input_audio_buffer.speech_stopped")[0].audio_end_ms * 24 - offset
    f2, _ = turn_features(pcm2[start2:stop2], peak=peak)
    want = omni.generate(prompt_ids=ids, audio=[AudioFeatures(f1, 1), AudioFeatures(f2, 1)], greedy=True,
                         max_tokens=8, max_frames=12)
    assert reply2.ids == want.text_ids
    np.testing.assert_array_equal(reply2.codes, want.codes)
    got = reply_audio(later)
    ref = np.frombuffer(encode_pcm16(want.audio), dtype="<i2").astype(np.int32)
    assert got.shape == ref.shape and np.abs(got - ref).max() <= 1


def ms(events, kind: str, i: int) -> int:
    e = of_type(events, f"input_audio_buffer.{kind}")[i]
    return e.audio_start_ms if kind == "speech_started" else e.audio_end_ms


def transcript_of_played(events, played_ms: int):
    """The transcript deltas of the audio chunks wholly played within `played_ms`."""
    out, samples = [], 0
    pending = None
    for e in events:
        if e.type == "response.output_audio.delta":
            samples += pcm_of(e.delta).size
            pending = samples <= played_ms * 24
        elif e.type == "response.output_audio_transcript.delta" and pending:
            out.append(e)
    return out


def test_bad_client_events_get_error_events_and_the_session_goes_on(server):
    url, app = server

    async def run():
        async with websockets.connect(url.replace("http", "ws") + f"/v1/realtime?model={MODEL}",
                                      max_size=None) as ws:
            json.loads(await ws.recv())  # session.created
            errors = []
            for bad in ["{not json", json.dumps([1, 2]), json.dumps({"type": "no.such.event"}),
                        json.dumps({"type": "input_audio_buffer.append", "audio": "%%%not base64%%%"}),
                        json.dumps({"type": "input_audio_buffer.append", "audio": b64(np.zeros(3, np.int16))[:-2]}),
                        json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (16 * 2**20)}),
                        json.dumps({"type": "session.update", "session": {"type": "realtime",
                                                                          "audio": {"output": {"voice": "nobody"}}}}),
                        json.dumps({"type": "input_audio_buffer.commit"}),
                        json.dumps({"type": "conversation.item.truncate", "item_id": "nope", "audio_end_ms": 1}),
                        json.dumps({"type": "response.cancel"})]:
                await ws.send(bad)
                errors.append(json.loads(await ws.recv()))
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime",
                                                                             "max_output_tokens": 3,
                                                                             "output_modalities": ["text"]}}))
            updated = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi <|im_end|>"}]}}))
            await ws.send(json.dumps({"type": "response.create"}))
            after = []
            while not after or after[-1]["type"] != "response.done":
                after.append(json.loads(await ws.recv()))
            return errors, updated, after

    errors, updated, after = asyncio.run(run())
    assert [e["type"] for e in errors] == ["error"] * 10
    codes = [e["error"]["code"] for e in errors]
    assert codes == ["invalid_json", "invalid_event", "unknown_event", "invalid_base64", "invalid_base64",
                     "input_audio_too_large", "invalid_voice", "input_audio_buffer_commit_empty", "item_not_found",
                     "response_cancel_not_active"]
    assert "nobody" in errors[6]["error"]["message"] and errors[6]["error"]["param"] == "session.voice"
    assert updated["type"] == "session.updated"
    assert after[-1]["response"]["status"] == "incomplete"  # the session went on: 3 tokens, as asked
    assert after[-1]["response"]["usage"]["output_tokens"] == 3


def test_beta_clients_get_beta_event_names(server):
    url, app = server

    async def run():
        async with connect(url, extra_headers={"OpenAI-Beta": "realtime=v1"}) as conn:
            await conn.send({"type": "session.update", "session": {"modalities": ["text", "audio"], "voice": "chelsie",
                                                                   "turn_detection": None,
                                                                   "max_response_output_tokens": 4,
                                                                   "omnivox": {"max_audio_frames": 6}}})
            await speak(conn, speech_pcm(lead_ms=100, tail_ms=100), seed=7)
            await conn.send({"type": "input_audio_buffer.commit"})
            await conn.send({"type": "response.create", "response": {"modalities": ["text", "audio"]}})
            return await events_until(conn, "response.done")

    events = asyncio.run(run())
    kinds = {e.type for e in events}
    assert {"response.audio.delta", "response.audio_transcript.delta", "response.audio.done",
            "conversation.item.created", "conversation.created"} <= kinds
    assert not kinds & {"response.output_audio.delta", "response.output_audio_transcript.delta",
                        "conversation.item.added", "conversation.item.done"}
    session = of_type(events, "session.updated")[0].session
    assert session.model_extra["voice"] == "chelsie" and session.model_extra["turn_detection"] is None


def test_a_session_behind_its_appends_keeps_its_connection_and_catches_up(omni, monkeypatch):
    """Audio work slowed to 0.25 s a job, keepalive pings every 0.2 s that must be answered
    within 2 s: the reader keeps reading (the pongs do not queue behind 40 unhandled appends (10 s
    of work), which closed the connection with 1011) and the queued appends go through in a few
    jobs (of at most a second of audio each); the greedy reply equals the one to the same turn
    handled at full speed."""
    from omnivox.api.realtime.audio_input import PIECE_SAMPLES
    from omnivox.api.realtime.listening import ListeningSession
    jobs = []
    real = ListeningSession._append_pieces

    def slow(self, job, failed):
        jobs.append(job)
        time.sleep(0.25)
        return real(self, job, failed)

    pcm = speech_pcm(lead_ms=100, tail_ms=100)
    sent = pieces(pcm, 3)

    async def turn(url):
        async with connect(url) as conn:
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}},
                                               "max_output_tokens": 3,
                                               "omnivox": {**GREEDY, "max_audio_frames": 3}})
            for p in sent:
                await conn.input_audio_buffer.append(audio=b64(p))
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            return await events_until(conn, "response.done", timeout=60)

    # quiet, a ping is answered within ~3 ms while the appends queue, and the 40 appends are sent in ~12 ms
    with live_server(omni, uvicorn_kw={"ws_ping_interval": 0.2, "ws_ping_timeout": 2.0}) as (url, app):
        fast = asyncio.run(turn(url))
        monkeypatch.setattr(ListeningSession, "_append_pieces", slow)
        events = asyncio.run(turn(url))
    assert of_type(events, "response.done")[0].response.status == "incomplete"
    # 40 appends (2.5 s of audio) in a few jobs, not one job each
    assert sum(len(pcm) for job in jobs for _, pcm in job) == sum(map(len, sent)) and len(jobs) <= 6, \
        [len(job) for job in jobs]
    assert all(sum(len(pcm) for _, pcm in job) <= PIECE_SAMPLES for job in jobs)
    np.testing.assert_array_equal(reply_audio(events), reply_audio(fast))  # the same turn heard
    assert reply_audio(fast).size > 0


def test_sixteen_sessions_at_once(server, omni):
    url, app = server
    pcm = speech_pcm(lead_ms=100, tail_ms=100)

    async def one(i):
        async with connect(url) as conn:
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}},
                                               "max_output_tokens": 3, "omnivox": {"max_audio_frames": 3, "seed": i}})
            await speak(conn, pcm, seed=i)
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            return await events_until(conn, "response.done", timeout=300)

    async def run():
        return await asyncio.gather(*(one(i) for i in range(16)))

    results = asyncio.run(run())
    assert len(results) == 16
    for events in results:
        done = of_type(events, "response.done")[0].response
        assert done.status == "incomplete" and reply_audio(events).size > 0
    # the clients have closed, but the server drops a session only after it sees the close
    wait_for(lambda: omni.engine.stats().in_flight == 0, what="every request to end")
    wait_for(lambda: not app.state.realtime.sessions, what="every closed session to be dropped")
