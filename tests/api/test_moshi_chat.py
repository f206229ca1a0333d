"""`/api/chat` (moshi's protocol, omnivox/api/moshi_chat.py) on the moshi demo, driven by the protocol
client that test_moshi_chat_reference.py checks against moshi's own server (one client, two servers).

- against `omnivox serve --model moshi-demo`: the handshake first, one audio message per input frame but
  the first, the audio close (Opus tolerance) to `Duplex.converse` on the input as the server decoded
  it, the text equal to the tokenizer's pieces of the same tokens, each after its frame's audio; the
  other routes answer a duplex model with a 400 naming why;
- on the same server (limits made small): the connection checks of `/v1/realtime`, the session limit,
  the idle close, bad Opus, a disconnect that cancels the engine request, the maximum session length
  (--duplex-max-session-s: closed with 1000 after its last frame's output) and a client that sends
  but stops reading (closed with 1008 and counted, its request cancelled);
- a server of its own, drained by SIGTERM: a new session is refused with 1013, running ones (one here,
  one on /v1/realtime) go on (the drain waits for them) until --drain-timeout, then are closed with
  1012; the process exits 0 within the bound."""
from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import signal
import socket
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np
import pytest
import websockets

from omnivox.api.lifecycle import exit_bound
from omnivox.audio.io import load_audio
from omnivox.audio.opus import OpusStreamDecoder
from omnivox.audio.output_stream import OpusStream

sphn = pytest.importorskip("sphn")

from api_helpers import metric, running_server, wait_for  # noqa: E402
from moshi_protocol_client import F, chat, opus_frames  # noqa: E402

SPEECH = load_audio(Path(__file__).resolve().parents[1] / "media" / "question_24k.wav", target_sr=24000)[:12 * F]
GREEDY = "?audio_temperature=0&text_temperature=0"
NAME = "omnivox-demo-moshi"
IDLE = 2.0  # --duplex-idle-timeout-s (it waits while frames sent have no answer yet)
MAX_S = 4.0  # --duplex-max-session-s: 50 frames
# a client that stops reading fills the socket's 1 KiB (--realtime-send-buffer-kb), the kernel's buffers (4.5 KiB
# sending, 2.3 KiB receiving: their least) in ~20 frames' output (~350 bytes of Opus each, and the text); then a
# send waits SEND_S (--realtime-send-timeout-s)
SEND_S = 2.0


@pytest.fixture(scope="module")
def duplex():
    from omnivox import Duplex
    return Duplex(model="moshi-demo")  # the demo in this session's OMNIVOX_CACHE, as the server's


@pytest.fixture(scope="module")
def served():
    """(http url, ws url) of `omnivox serve --model moshi-demo`: API key "k", one session at a time, a short idle
    bound, a short maximum length, a small send buffer and a short send timeout."""
    with running_server(Path(os.environ["OMNIVOX_CACHE"]), "--model", "moshi-demo", "--max-running", "2",
                        "--api-key", "k", "--max-realtime-sessions", "1", "--duplex-idle-timeout-s", str(IDLE),
                        "--duplex-max-session-s", str(MAX_S), "--realtime-send-buffer-kb", "1",
                        "--realtime-send-timeout-s", str(SEND_S)) as (url, _, _):
        yield url, url.replace("http", "ws", 1) + "/api/chat"


def delay_and_error(got: np.ndarray, want: np.ndarray) -> tuple[int, float]:
    """The lag (samples) that best aligns got with want (Opus's encoder delay), and the error's energy over want's."""
    errs = []
    for lag in range(400):
        n = min(len(got) - lag, len(want))
        errs.append(np.sum((got[lag:lag + n] - want[:n]) ** 2) / np.sum(want[:n] ** 2))
    return int(np.argmin(errs)), float(min(errs))


def test_client_against_omnivox_serve(served, duplex):
    result = asyncio.run(chat(served[1] + GREEDY, SPEECH, headers=KEY))
    frames = len(SPEECH) // F  # the client sends these and one silent frame: frames messages come back
    assert result.first == b"\x00"
    assert [k for k in result.kinds if k == 1] == [1] * frames and set(result.kinds) <= {1, 2}
    assert all(len(a) == F for a in result.audio)

    heard = OpusStreamDecoder(24000).push(b"".join(result.sent))  # the input as the server decoded it
    assert len(heard) == (frames + 1) * F
    want = duplex.converse(heard, greedy=True)
    assert want.frames == frames
    # the same frames, Opus-coded: exactly what the server's encoder makes of converse's audio (sphn
    # decoding it), and within Opus's error of the audio itself (the demo's audio is noise, which 32 kbps
    # Opus keeps only roughly: measured 0.62 of its energy; audio one frame off gives 1.1)
    encoder, reader = OpusStream(24000), sphn.OpusStreamReader(24000)
    coded = [reader.append_bytes(encoder.push(want.audio[i:i + F])) for i in range(0, len(want.audio), F)]
    np.testing.assert_array_equal(result.pcm, np.concatenate(coded))
    lag, err = delay_and_error(result.pcm, want.audio)
    assert 140 <= lag <= 170 and err < 0.8, (lag, err)

    pieces = [(i + 1, duplex.tokenizer.piece(int(t))) for i, t in enumerate(want.tokens[:frames - 1, 0])]
    want_text = [(after, p) for after, p in pieces if p]
    got_text = [(after, t) for after, t in zip(result.text_after, result.text) if after < frames]
    assert got_text == want_text  # each piece right after its frame's audio


def test_http_routes_refuse_a_duplex_model_in_one_line(served):
    url = served[0]
    chat_reply = httpx.post(url + "/v1/chat/completions", headers=KEY, json={"model": NAME, "messages": [
        {"role": "user", "content": "hi"}]})
    assert chat_reply.status_code == 400 and "/api/chat" in chat_reply.json()["error"]["message"]
    speech = httpx.post(url + "/v1/audio/speech", headers=KEY, json={"model": NAME, "input": "hi", "voice": "x"})
    assert speech.status_code == 400 and "full duplex" in speech.json()["error"]["message"]
    card = httpx.get(url + f"/v1/models/{NAME}", headers=KEY).json()
    assert card["family"] == "moshi"


KEY = {"Authorization": "Bearer k"}


async def _session(url: str, headers: dict | None = None, send: list[bytes] = (), protocols=()) -> list:
    """Connect, send `send` (binary), read until the server closes: [messages..., (close code, reason)]."""
    out = []
    async with aiohttp.ClientSession() as s, s.ws_connect(url, headers=headers, protocols=protocols) as ws:
        for data in send:
            await ws.send_bytes(data)
        async with asyncio.timeout(60):
            while (message := await ws.receive()).type == aiohttp.WSMsgType.BINARY:
                out.append(message.data)
    assert message.type == aiohttp.WSMsgType.CLOSE, message
    return [*out, (message.data, message.extra)]


@pytest.mark.parametrize("headers, protocols, query, code, reason", [
    (None, (), "", 4401, "API key"),
    ({"Authorization": "Bearer wrong"}, (), "", 4401, "API key"),
    ({**KEY, "Origin": "http://evil.example"}, (), "", 4403, "web origin"),
    (KEY, (), "?audio_topk=many", 4400, "audio_topk must be an integer"),
    (None, ("openai-insecure-api-key.k",), "?text_temperature=-1", 4400, "temp_text must be non-negative"),
])
def test_connection_is_checked_as_realtime_is(served, headers, protocols, query, code, reason):
    out = asyncio.run(_session(served[1] + query, headers, protocols=protocols))
    assert out[-1][0] == code and reason in out[-1][1] and len(out) == 1, out  # nothing but the close


def _metric_or_zero(text: str, name: str, **labels: str) -> float:
    try:
        return metric(text, name, **labels)
    except KeyError:
        return 0.0


def in_flight(url: str) -> int:
    return httpx.get(url + "/health").json()["in_flight"]


def test_session_limit_idle_close_and_disconnect(served):
    url, ws_url = served

    async def two() -> tuple[list, aiohttp.WSMessage]:
        async with aiohttp.ClientSession() as s, s.ws_connect(ws_url, headers=KEY) as ws:
            assert (await ws.receive()).data == b"\x00"
            second = await _session(ws_url, KEY)  # over the limit of one
            async with asyncio.timeout(30):
                return second, await ws.receive()  # the first sends nothing: the idle bound closes it

    before = httpx.get(url + "/metrics").text
    second, closed = asyncio.run(two())
    assert second[-1][0] == 1013 and len(second) == 1
    assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 1000 and f"no message for {IDLE:g} s" in closed.extra
    wait_for(lambda: in_flight(url) == 0, what="the sessions' requests ended")
    after = httpx.get(url + "/metrics").text
    for name, labels in (("omnivox_moshi_chat_sessions_refused_total", {"reason": "server_overloaded"}),
                         ("omnivox_moshi_chat_idle_closes_total", {}), ("omnivox_moshi_chat_sessions_total", {})):
        assert metric(after, name, **labels) == _metric_or_zero(before, name, **labels) + 1, name
    assert metric(after, "omnivox_moshi_chat_sessions_active") == 0

    async def leave() -> None:  # sends a few frames and goes away
        async with aiohttp.ClientSession() as s, s.ws_connect(ws_url, headers=KEY) as ws:
            assert (await ws.receive()).data == b"\x00"
            for p in opus_frames(SPEECH[:3 * F]):
                await ws.send_bytes(b"\x01" + p)
            assert (await ws.receive()).data[0] == 1  # the session runs
            assert in_flight(url) == 1
    asyncio.run(leave())
    wait_for(lambda: in_flight(url) == 0, what="the disconnect cancelled the request")


def test_bad_opus_closes_with_4400(served):
    out = asyncio.run(_session(served[1], KEY, send=[b"\x01RIFF" + bytes(60), b"\x01more"]))
    assert out[0] == b"\x00" and out[-1][0] == 4400 and "not an Ogg stream" in out[-1][1]


def test_a_session_at_its_maximum_length_is_closed_with_1000(served):
    """--duplex-max-session-s 4: the session takes 50 input frames (4 s at 12.5 frames/s), answers each
    but the first, then closes with 1000 and the reason; the frames sent past it are ignored."""
    frames = math.ceil(MAX_S * 12.5)
    pcm = np.tile(SPEECH, 6)[:(frames + 5) * F]
    out = asyncio.run(_session(served[1], KEY, send=[b"\x01" + p for p in opus_frames(pcm)]))
    assert out[0] == b"\x00" and [m[0] for m in out[1:-1]].count(1) == frames - 1
    assert out[-1][0] == 1000 and out[-1][1] == f"the session reached its maximum length ({MAX_S:g} s of audio, " \
                                                 "--duplex-max-session-s)", out[-1]
    wait_for(lambda: in_flight(served[0]) == 0, what="the session's request to end")


def test_a_client_that_stops_reading_is_closed_with_1008_and_counted(served):
    """A client that sends 40 frames (its receive buffer the kernel's least) and reads nothing: once
    the buffers hold the output, a send waits SEND_S and the server closes it with 1008 (the close
    frame behind what it left unread), counts it (api moshi_chat) and cancels its request."""
    url, ws_url = served

    def dropped() -> float:
        return _metric_or_zero(httpx.get(url + "/metrics").text, "omnivox_slow_readers_dropped_total",
                               api="moshi_chat", reason="send_timeout")

    async def deaf() -> tuple[int, websockets.frames.Close | None]:
        host, port = url.rsplit("/", 1)[-1].split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # set before connecting: a small window
        sock.connect((host, int(port)))
        # reads ahead one message at most; no pings of its own
        async with websockets.connect(ws_url, sock=sock, additional_headers=KEY, max_queue=1, ping_interval=None,
                                      max_size=None) as ws:
            for p in opus_frames(np.tile(SPEECH, 2)[:40 * F]):
                await ws.send(b"\x01" + p)
            await asyncio.to_thread(wait_for, lambda: dropped() == before + 1, 60, "the drop to be counted")
            audio = 0
            try:  # it reads at last: what was unsent, then the close frame
                while True:
                    audio += (await asyncio.wait_for(ws.recv(), 30))[0] == 1
            except websockets.ConnectionClosed as e:
                return audio, e.rcvd

    before = dropped()
    audio, closed = asyncio.run(deaf())
    assert closed is not None and closed.code == 1008 and "--realtime-send-timeout-s" in closed.reason, closed
    assert 0 < audio < 40 - 1  # part of the output, then the close: the rest was never made
    wait_for(lambda: in_flight(url) == 0, what="its request to be cancelled")


def test_a_maximum_length_over_the_models_is_refused_in_one_line(duplex):
    from omnivox.errors import OmnivoxError
    from omnivox.serve import duplex_max_session_s

    assert duplex_max_session_s(duplex.served, 3600) == 3600 and duplex_max_session_s(duplex.served, None) is None
    with pytest.raises(OmnivoxError) as e:
        duplex_max_session_s(duplex.served, 3601)
    assert str(e.value) == "--duplex-max-session-s 3601 is over this model's session limit of 3600 s"


DRAIN_S = 3  # --drain-timeout of the drained server: the test's checks while it drains take well under it


def test_drain_lets_sessions_go_on_then_closes_them_with_1012():
    """SIGTERM with two live sessions, one on /api/chat and one on /v1/realtime (each client sending a frame
    every 80 ms): readiness says draining with both counted, a new session is refused with 1013, the running
    ones get their frames answered until --drain-timeout, then are closed with 1012 (never 1011; the realtime
    one after an `error` event, code `draining`), and the process exits 0 within the bound."""
    live = np.tile(SPEECH, 8)[:200 * F]

    async def chat_session(s, ws_url, answered, closed) -> None:
        async with s.ws_connect(ws_url) as ws:
            assert (await ws.receive()).data == b"\x00"

            async def send() -> None:  # a live client: a frame every 80 ms, for longer than the drain lasts
                for p in opus_frames(live):
                    await ws.send_bytes(b"\x01" + p)
                    await asyncio.sleep(0.08)
            sender = asyncio.ensure_future(send())
            try:
                while (m := await ws.receive()).type == aiohttp.WSMsgType.BINARY:
                    answered["chat"] += m.data[0] == 1
                closed["chat"] = (m.data, m.extra, None)
            finally:
                sender.cancel()

    async def realtime_session(s, url, answered, closed) -> None:
        pcm16 = (np.clip(live, -1, 1) * 32767).astype("<i2")
        async with s.ws_connect(url.replace("http", "ws", 1) + "/v1/realtime") as ws:
            async def send() -> None:
                for i in range(0, len(pcm16), F):
                    await ws.send_json({"type": "input_audio_buffer.append",
                                        "audio": base64.b64encode(pcm16[i:i + F].tobytes()).decode()})
                    await asyncio.sleep(0.08)
            sender, error = asyncio.ensure_future(send()), None
            try:
                while (m := await ws.receive()).type == aiohttp.WSMsgType.TEXT:
                    event = json.loads(m.data)
                    answered["realtime"] += event["type"] == "response.output_audio.delta"
                    if event["type"] == "error":
                        error = event["error"]["code"]
                closed["realtime"] = (m.data, m.extra, error)
            finally:
                sender.cancel()

    async def drain(url: str, proc) -> tuple[dict, list, dict, dict, float]:
        ws_url = url.replace("http", "ws", 1) + "/api/chat"
        answered, closed = {"chat": 0, "realtime": 0}, {}
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.ensure_future(chat_session(s, ws_url, answered, closed)),
                     asyncio.ensure_future(realtime_session(s, url, answered, closed))]
            try:
                await until(lambda: min(answered.values()) >= 3, "both sessions to answer")
                proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                report = {}

                async def draining() -> bool:
                    report.update((await asyncio.to_thread(httpx.get, url + "/health/ready")).json())
                    return report["draining"]
                await until(draining, "the drain to start")
                refused = await _session(ws_url)
                at_drain = dict(answered)
                async with asyncio.timeout(exit_bound(DRAIN_S)):
                    await asyncio.gather(*tasks)
                return report, refused, {k: answered[k] - at_drain[k] for k in answered}, closed, signalled
            finally:
                for task in tasks:
                    task.cancel()

    # fifo: two sessions at once are what this test holds, whatever the machine's load (slack's frame-deadline
    # admission could refuse the second on a loaded one)
    with running_server(Path(os.environ["OMNIVOX_CACHE"]), "--model", "moshi-demo", "--scheduling", "fifo",
                        "--drain-timeout", str(DRAIN_S)) as (url, proc, log):
        report, refused, answered, closed, signalled = asyncio.run(drain(url, proc))
        assert proc.wait(timeout=max(0.0, signalled + exit_bound(DRAIN_S) - time.monotonic())) == 0
        text = log.read_text()
    assert report["state"] == "draining" and not report["ready"] and report["realtime_sessions"] == 2, report
    assert len(refused) == 1 and refused[0][0] == 1013 and "draining" in refused[0][1], refused
    assert min(answered.values()) > 0, answered  # the sessions went on while the server drained
    assert closed["chat"][:2] == (1012, closed["chat"][1]) and "--drain-timeout" in closed["chat"][1], \
        (closed, text[-2000:])
    assert closed["realtime"][0] == 1012 and closed["realtime"][2] == "draining", (closed, text[-2000:])
    assert "SIGTERM: draining, 2 request(s) running" in text and "drain timeout: 2 request(s)" in text, text[-2000:]
    assert "Traceback" not in text, text[-3000:]


async def until(predicate, what: str, timeout: float = 30.0) -> None:
    """Await `predicate()` (a coroutine function or a plain one) until it holds; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not ((await r) if asyncio.iscoroutine(r := predicate()) else r):
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(0.05)


def test_an_engine_request_a_drain_fails_closes_with_1012():
    from omnivox.api.moshi_chat import failed_code
    from omnivox.engine.events import Failed

    assert failed_code(Failed("cut", 503, code="draining")) == 1012  # "service restart", not 1011
    assert failed_code(Failed("broken", 503, code="engine_failed")) == 1011
    assert failed_code(Failed("too long", 413)) == 4413
