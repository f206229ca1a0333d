"""Realtime sessions against hostile or broken clients (issue 18 items 5 and 3), over a real
WebSocket and real HTTP on 127.0.0.1: open sessions do not take HTTP requests' room (a session's
open turn counts against --max-realtime-sessions only; its response counts against --max-running
like any request), sessions beyond --max-realtime-sessions are refused with 1013, and a client
that stops reading is dropped (1008 after --realtime-send-timeout-s, or by the keepalive when it
answers no ping), counted, and its reply cancelled while another session goes on."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
import torch
import websockets
from websockets.exceptions import ConnectionClosed

from omnivox import Omni
from omnivox.api.realtime import RealtimeLimits
from omnivox.engine.config import EngineConfig
from realtime_helpers import MODEL, b64, live_server, speech_pcm, wait_for, ws_url


@pytest.fixture(scope="module")
def omni(demo_cache):
    torch.set_num_threads(1)
    o = Omni(model=demo_cache[1], progress=False, engine_config=EngineConfig(max_running=2, max_queue=1))
    yield o
    o.close()


SPEECH = speech_pcm(lead_ms=0, tail_ms=0)


async def opened(url: str, n: int, speaking: bool = False) -> list:
    """n sessions; `speaking`: each with an open user turn (manual turns, half a second of speech
    appended), so each holds its next response's engine request."""
    held = [await websockets.connect(ws_url(url), max_size=None) for _ in range(n)]
    for ws in held:
        assert json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "session.created"
        if speaking:
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "audio": {"input": {"turn_detection": None}}}}))
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(SPEECH[:12000])}))
    return held


async def recv_until(ws, kind: str, timeout: float = 60.0) -> list[dict]:
    got: list[dict] = []
    while not got or got[-1]["type"] != kind:
        got.append(json.loads(await asyncio.wait_for(ws.recv(), timeout)))
    return got


def chat(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 3, "modalities": ["text"], "messages": [{"role": "user", "content": "Hi"}]})


def test_open_sessions_leave_http_its_room(omni):
    """max_running 2 + max_queue 1 = 3 requests; 3 sessions, each holding an open turn (a streamed
    prompt waiting for the user), used to make every chat answer 503. Now a chat is answered; a
    4th session is refused with 1013 and says which flag."""
    limits = RealtimeLimits(max_sessions=3)

    async def run(url):
        held = await opened(url, 3, speaking=True)
        try:
            wait_for(lambda: omni.engine.stats().in_flight == 3, what="each session's open prompt")
            answered = await asyncio.to_thread(chat, url)
            with pytest.raises(ConnectionClosed) as refused:
                async with websockets.connect(ws_url(url)) as ws:
                    await asyncio.wait_for(ws.recv(), 30)
            return answered, refused.value.rcvd
        finally:
            for ws in held:
                await ws.close()

    with live_server(omni, realtime=limits) as (url, app):
        answered, refused = asyncio.run(run(url))
        wait_for(lambda: omni.engine.stats().in_flight == 0, what="the sessions' requests to end")
    assert answered.status_code == 200, answered.text
    assert answered.json()["choices"][0]["message"]["content"]
    assert refused.code == 1013 and "3 sessions" in refused.reason and "--max-realtime-sessions" in \
        refused.reason, refused


def test_max_realtime_sessions_defaults_to_max_running(omni):
    async def run(url):
        held = await opened(url, 2)
        try:
            with pytest.raises(ConnectionClosed) as refused:
                async with websockets.connect(ws_url(url)) as ws:
                    await asyncio.wait_for(ws.recv(), 30)
            return refused.value.rcvd
        finally:
            for ws in held:
                await ws.close()

    with live_server(omni) as (url, app):
        refused = asyncio.run(run(url))
    assert refused.code == 1013 and "at most 2" in refused.reason, refused


def small_socket(url: str) -> socket.socket:
    """A connected client socket with a small receive buffer, so a client that stops reading
    fills the server's side quickly."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    return sock


def dropped(app, reason: str | None = None) -> float:
    """Clients the server dropped for not reading (`omnivox_slow_readers_dropped_total`), realtime ones."""
    return sum(v for k, v in app.state.metrics.slow_readers.values.items()
               if ("api", "realtime") in k and (reason is None or ("reason", reason) in k))


def test_a_client_that_stops_reading_is_closed_and_its_reply_cancelled(omni):
    """A raw client asks for a long spoken reply and never reads: after --realtime-send-timeout-s
    with over its send buffer unsent (64 KiB here, so the buffers fill in a few frames) it is closed
    with 1008 (the close frame waits behind what it left unread), or, should the buffers take longer
    to fill than the keepalive's pings go unanswered (a loaded machine), by the keepalive; either way
    the drop is counted, its engine request is aborted and every KV page comes back, while another
    session answers as before."""
    limits = RealtimeLimits(send_timeout_s=1.0, send_buffer_bytes=64 * 2**10)
    long_reply = {"type": "session.update", "session": {
        "type": "realtime", "audio": {"input": {"turn_detection": None}}, "max_output_tokens": 400,
        "omnivox": {"max_audio_frames": 4000, "seed": 1}}}  # seeded: a reply of over 3 MiB every run
    ask = {"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me a long story."}]}}

    async def run(url, app):
        hub = app.state.realtime
        # no pings of its own: a client whose keepalive gives up leaves by itself (not a drop)
        deaf = await websockets.connect(ws_url(url), sock=small_socket(url), server_hostname=None, max_size=None,
                                        max_queue=1, ping_interval=None)
        for event in (long_reply, ask, {"type": "response.create"}):
            await deaf.send(json.dumps(event))
        # the reply is far more than the buffers hold; a bound for liveness only (past 120 s once, with
        # 1 MiB of send buffer and two other test runs on the same two cores)
        deadline = time.monotonic() + 300
        while not dropped(app):
            assert time.monotonic() < deadline, ("the client that stops reading was never closed", omni.engine.stats(),
                                                 hub.metrics.responses.values, hub.metrics.errors.values,
                                                 [(s.id, s.responses.run) for s in hub.sessions.values()])
            await asyncio.sleep(0.05)
        closed = None
        try:  # it reads at last: what was unsent, then the close frame (the keepalive's drop discards both)
            while True:
                await asyncio.wait_for(deaf.recv(), 30)
        except ConnectionClosed as e:
            closed = e.rcvd
        async with websockets.connect(ws_url(url)) as ws:  # another session works as before
            await recv_until(ws, "session.created")
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "max_output_tokens": 3, "output_modalities": ["text"]}}))
            await ws.send(json.dumps(ask))
            await ws.send(json.dumps({"type": "response.create"}))
            done = (await recv_until(ws, "response.done"))[-1]
        return closed, done

    with live_server(omni, realtime=limits) as (url, app):
        closed, done = asyncio.run(run(url, app))
        wait_for(lambda: not app.state.realtime.sessions, what="the sessions to end")
        wait_for(lambda: omni.engine.stats().in_flight == 0, what="the slow reader's request to be cancelled")
        s = omni.engine.stats()
        by_send_timeout = dropped(app, "send_timeout")
    assert not by_send_timeout or closed is not None and closed.code == 1008 and \
        "--realtime-send-timeout-s" in closed.reason, closed
    assert s.aborted >= 1 and s.kv_pages_free == s.kv_pages_total
    assert done["response"]["status"] == "incomplete" and done["response"]["usage"]["output_tokens"] == 3


def test_a_client_that_answers_no_ping_is_dropped_and_counted(omni):
    """A raw WebSocket client that completes the upgrade and then reads nothing, so it answers none
    of the keepalive's pings (0.5 s here; uvicorn's default 20 s): the server fails the connection
    (1011), the session ends and the drop counts with the send timeout's, reason keepalive."""
    def deaf_upgrade(url: str) -> socket.socket:
        sock = small_socket(url)
        host = url.rsplit("/", 1)[-1]
        sock.sendall((f"GET /v1/realtime?model={MODEL} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
                      "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                      "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        return sock

    with live_server(omni, uvicorn_kw={"ws_ping_interval": 0.5, "ws_ping_timeout": 0.5}) as (url, app):
        with deaf_upgrade(url):
            wait_for(lambda: app.state.realtime.sessions, what="the session to open")
            wait_for(lambda: dropped(app, "keepalive") == 1, what="the keepalive's drop to count")
            wait_for(lambda: not app.state.realtime.sessions, what="the session to end")
        assert chat(url).status_code == 200
