"""What `/v1/realtime` refuses and frees: the API key (header, or the browser's subprotocol), web
origins, another model, more sessions than --max-realtime-sessions, a client that vanishes
mid-response (every page back), an idle client, an over-full input buffer."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest
import torch
import websockets
from websockets.exceptions import ConnectionClosedError

from omnivox import Omni
from omnivox.api.realtime import RealtimeLimits
from omnivox.engine.config import EngineConfig
from realtime_helpers import MODEL, b64, live_server, speech_pcm, wait_for, ws_url

KEY = "sk-realtime-test"


@pytest.fixture(scope="module")
def omni(demo_cache):
    torch.set_num_threads(1)
    o = Omni(model=demo_cache[1], progress=False, engine_config=EngineConfig(max_running=2, max_queue=1))
    yield o
    o.close()


async def status_of(url: str, **kw) -> int | str:
    """The HTTP status a refusal stands for (close code 4000 + status, or 1013 for 503; a refusal
    always says why), else the first event's type."""
    try:
        async with websockets.connect(url, **kw) as ws:
            return json.loads(await ws.recv())["type"]
    except ConnectionClosedError as e:
        assert e.rcvd is not None and e.rcvd.reason  # a refusal says why
        return 503 if e.rcvd.code == 1013 else e.rcvd.code - 4000


def no_sessions(app) -> None:
    """Until the server has let go of every session whose client closed (it learns of a close
    asynchronously): a session opened next does not meet --max-realtime-sessions."""
    wait_for(lambda: not app.state.realtime.sessions, what="the closed sessions to be let go")


async def recv_until(ws, kind: str) -> list[dict]:
    got = []
    while not got or got[-1]["type"] != kind:
        got.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
    return got


async def read_until(ws, predicate, what: str, timeout: float = 30.0) -> None:
    """Read (and drop) server events until `predicate()` holds: the server keeps streaming meanwhile."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        try:
            await asyncio.wait_for(ws.recv(), 0.02)
        except asyncio.TimeoutError:
            pass


def test_api_key_on_the_upgrade(omni):
    from openai import AsyncOpenAI

    async def official(url, key):
        client = AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        async with client.realtime.connect(model=MODEL) as conn:
            return (await conn.recv()).type

    with live_server(omni, api_key=KEY) as (url, app):
        assert asyncio.run(official(url, KEY)) == "session.created"
        with pytest.raises(Exception) as refused:
            asyncio.run(official(url, "sk-wrong"))
        assert "401" in str(refused.value)
        assert asyncio.run(status_of(ws_url(url))) == 401
        browser = ["realtime", f"openai-insecure-api-key.{KEY}"]
        no_sessions(app)
        assert asyncio.run(status_of(ws_url(url), subprotocols=browser)) == "session.created"
        assert asyncio.run(status_of(ws_url(url), subprotocols=["realtime", "openai-insecure-api-key.nope"])) == 401

        async def chosen():
            async with websockets.connect(ws_url(url), subprotocols=browser) as ws:
                return ws.subprotocol
        no_sessions(app)
        assert asyncio.run(chosen()) == "realtime"  # browsers need the server to pick one they offered


def test_origins_and_model(omni):
    limits = RealtimeLimits(allowed_origins=("http://app.example:5173",))
    with live_server(omni, realtime=limits) as (url, app):
        port = url.rsplit(":", 1)[1]

        def run(**kw):
            no_sessions(app)  # at most 2 sessions (max_running): the last one's close is seen first
            return asyncio.run(status_of(ws_url(url), **kw))
        assert run() == "session.created"  # no Origin: not a web page (SDKs, curl)
        assert run(origin=f"http://127.0.0.1:{port}") == "session.created"  # the playground's own origin
        assert run(origin="http://app.example:5173") == "session.created"  # --allowed-origins
        assert run(origin="http://evil.example") == 403
        assert run(origin=f"http://127.0.0.1:{int(port) + 1}") == 403  # another port is another origin
        # DNS rebinding: a page whose name now points here sends its own name as Host: a Host the
        # server does not answer (HostPolicy, as on every HTTP route), with or without an Origin
        rebound = f"ws://rebound.example:{port}/v1/realtime?model={MODEL}"
        for origin in (f"http://rebound.example:{port}", None):
            assert asyncio.run(status_of(rebound, origin=origin, host="127.0.0.1", port=int(port))) == 400
        assert asyncio.run(status_of(ws_url(url, "gpt-realtime"))) == 404
        refused = app.state.realtime.metrics.refused.values
        assert refused[(("reason", "cross_origin_refused"),)] == 2 and refused[(("reason", "invalid_host"),)] == 2


def test_sessions_count_against_max_realtime_sessions(omni):
    async def run(url):
        first = [await websockets.connect(ws_url(url)) for _ in range(2)]  # --max-realtime-sessions: max_running 2
        for ws in first:
            assert json.loads(await ws.recv())["type"] == "session.created"
        refused = await status_of(ws_url(url))
        await first[0].close()
        wait_for(lambda: len(app.state.realtime.sessions) == 1, what="the session to end")
        again = await status_of(ws_url(url))
        for ws in first[1:]:
            await ws.close()
        return refused, again

    with live_server(omni) as (url, app):
        assert asyncio.run(run(url)) == (503, "session.created")


def test_a_vanished_client_frees_everything(omni):
    """The client disappears (no close handshake) while a reply streams and the next turn is being
    spoken: both engine requests are cancelled, every KV page comes back, the session is gone."""
    pcm = speech_pcm(lead_ms=100, tail_ms=100)

    async def run(url):
        ws = await websockets.connect(ws_url(url), max_size=None)
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "audio": {"input": {"turn_detection": None}}, "max_output_tokens": 400,
            "omnivox": {"max_audio_frames": 2000}}}))
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(pcm)}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "response.create"}))
        await recv_until(ws, "response.output_audio.delta")
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(pcm[:24000])}))
        (session,) = app.state.realtime.sessions.values()
        await read_until(ws, lambda: session.turn is not None, "the next turn to open")
        ws.transport.abort()

    with live_server(omni) as (url, app):
        engine = omni.engine
        asyncio.run(run(url))
        wait_for(lambda: not app.state.realtime.sessions, what="the session to close")
        wait_for(lambda: engine.stats().in_flight == 0, what="the requests to be cancelled")
        s = engine.stats()
        assert s.kv_pages_free == s.kv_pages_total
        assert s.aborted >= 1
        assert app.state.realtime.metrics.active.values[()] == 0


def test_idle_sessions_are_closed_and_buffers_are_bounded(omni):
    # every server reply below comes within ~0.02 s quiet; the idle timeout must not fire between them
    limits = RealtimeLimits(idle_timeout_s=2.0, max_buffer_s=1.0)

    async def run(url):
        async with websockets.connect(ws_url(url)) as ws:
            await recv_until(ws, "session.created")
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "audio": {"input": {"turn_detection": None}}}}))
            await recv_until(ws, "session.updated")
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(np.zeros(20000, np.int16))}))
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(np.zeros(8000, np.int16))}))
            full = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            committed = await recv_until(ws, "conversation.item.done")
            idle = json.loads(await asyncio.wait_for(ws.recv(), 30))
            try:
                await asyncio.wait_for(ws.recv(), 30)
                closed = False
            except websockets.ConnectionClosed as e:
                closed = e.rcvd.code if e.rcvd else True
            return full, committed, idle, closed

    with live_server(omni, realtime=limits) as (url, app):
        full, committed, idle, closed = asyncio.run(run(url))
    assert full["type"] == "error" and full["error"]["code"] == "input_audio_buffer_full"
    assert committed[-3]["type"] == "input_audio_buffer.committed"  # the first 20000 samples stayed
    assert idle["type"] == "error" and idle["error"]["code"] == "idle_timeout"
    assert closed == 1000


def test_serve_flags_reach_realtime_sessions(demo_cache):
    """`omnivox serve` (a real process): --allowed-origins, --realtime-idle-timeout-s and
    --realtime-audio-window-s reach the route; an append near 15 MiB is read (the WebSocket
    message limit is above it) and refused with an error event, not a closed connection; a session
    outlives --header-timeout, whose deadline ends with the upgrade (it used to close every
    WebSocket --header-timeout seconds after it opened, with no close frame); and with
    --max-realtime-sessions 1 a second session gets 1013."""
    from api_helpers import metric, running_server

    huge = json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (15 * 2**20 + 4)})

    async def run(url):
        async with websockets.connect(ws_url(url), origin="http://app.example:5173", max_size=None) as ws:
            created = json.loads(await ws.recv())
            await ws.send(huge)
            big = json.loads(await ws.recv())
            idle = json.loads(await asyncio.wait_for(ws.recv(), 30))
            return created, big, idle

    async def outlives(url):
        async with websockets.connect(ws_url(url)) as ws:
            json.loads(await ws.recv())  # session.created
            await asyncio.sleep(2.5)  # past --header-timeout
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
            return json.loads(await asyncio.wait_for(ws.recv(), 30))

    async def second(url):
        async with websockets.connect(ws_url(url)) as held:
            json.loads(await held.recv())  # session.created
            with pytest.raises(ConnectionClosedError) as refused:
                async with websockets.connect(ws_url(url)) as ws:
                    await asyncio.wait_for(ws.recv(), 30)
            return refused.value.rcvd

    def no_sessions_left(url) -> None:
        wait_for(lambda: metric(httpx.get(url + "/metrics", timeout=30).text, "omnivox_realtime_sessions_active") == 0,
                 what="the session to end")

    # the idle timeout must not fire before the append is answered (~0.25 s quiet), nor while a
    # session waits out the header timeout or is held while a second one is refused
    with running_server(demo_cache[0], "--allowed-origins", "http://app.example:5173", "--realtime-idle-timeout-s",
                        "5", "--realtime-audio-window-s", "2", "--max-realtime-sessions", "1", "--header-timeout", "1",
                        "--realtime-send-timeout-s", "2") as (url, proc, log):
        created, big, idle = asyncio.run(run(url))
        assert asyncio.run(status_of(ws_url(url), origin="http://other.example")) == 403
        no_sessions_left(url)
        assert asyncio.run(outlives(url))["type"] == "session.updated"
        no_sessions_left(url)
        refused = asyncio.run(second(url))
    ext = created["session"]["omnivox"]
    assert (ext["audio_window_s"], ext["audio_window_chunks"]) == (2.0, 2)
    assert big["type"] == "error" and big["error"]["code"] == "input_audio_too_large"
    assert idle["error"]["code"] == "idle_timeout"
    assert refused.code == 1013 and "at most 1: --max-realtime-sessions" in refused.reason, refused
