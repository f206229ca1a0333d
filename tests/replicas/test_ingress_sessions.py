"""`omnivox serve --replicas`' ingress forwarding `/api/chat` (a full-duplex model, moshi's binary
protocol) as it forwards `/v1/realtime`, with the same function (`ingress.Sessions`): through it, the
protocol client gets the handshake first and one audio frame per input frame but the first; the
replica's close codes and reasons come through; while the ingress drains a new session is closed
with 1013 while the running one goes on, counted in what the drain waits for, until the drain's end
closes it with 1012 and its engine request ends.

In this process, without Ray: the ingress's `Sessions` behind uvicorn, calling a real
`EngineReplica`'s session methods (`ws_open`, `ws_send`, `ws_close`, over `bridge.Socket`) on the
moshi demo's own app, through `LocalHandle`, which stands for Serve's `DeploymentHandle` only. Why
not on Ray: the package's shared cluster serves the Qwen demo on its 2 CPUs (both replicas'), so a
moshi-demo replica needs a Ray instance and Serve application of its own, which takes tens of
seconds to minutes on the loaded 2-core test machine (test_drain.py's two replicas once took 138 s),
past this test's budget; the Ray transport of a session (its calls pinned to one replica by
`session_id`) is the realtime sessions' own, which test_replicas.py runs on the cluster."""
from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from fastapi import FastAPI, WebSocket

pytest.importorskip("ray")
sphn = pytest.importorskip("sphn")

from api_helpers import serving_app, wait_for  # noqa: E402
from moshi_protocol_client import F, chat, opus_frames  # noqa: E402

from omnivox.audio.io import load_audio  # noqa: E402
from omnivox.api.lifecycle import Lifecycle  # noqa: E402
from omnivox.api.server import create_app  # noqa: E402
from omnivox.replicas.engine import EngineReplica  # noqa: E402
from omnivox.replicas.ingress import Sessions  # noqa: E402

SPEECH = load_audio(Path(__file__).resolve().parents[1] / "media" / "question_24k.wav", target_sr=24000)
GREEDY = "?audio_temperature=0&text_temperature=0"


class LocalHandle:
    """Serve's DeploymentHandle as the ingress calls it (`options(...)`; `method.remote(...)`: an
    awaitable, or with `stream=True` an async iterator), calling one replica in this process."""

    def __init__(self, replica):
        self.replica = replica

    def options(self, **_) -> LocalHandle:
        return self

    def __getattr__(self, name: str):
        return SimpleNamespace(remote=getattr(self.replica, name))


def replica_of(app) -> EngineReplica:
    """An EngineReplica serving `app` (its constructor loads a model inside Serve: set by hand here)."""
    replica = EngineReplica.__new__(EngineReplica)
    replica.replica, replica.front, replica.sockets = "local", app, {}
    return replica


@pytest.fixture(scope="module")
def ingress():
    """(ws url of the ingress's /api/chat, its Sessions, its event loop, the replica's engine)."""
    from omnivox import Duplex

    model = Duplex(model="moshi-demo").served
    app = create_app(model, "omnivox-demo-moshi")
    sessions, loops = Sessions(LocalHandle(replica_of(app)), Lifecycle("serving")), []
    front = FastAPI()

    @front.websocket("/api/chat")  # the ingress's route
    async def session(ws: WebSocket):
        loops[:] = [asyncio.get_running_loop()]
        await sessions.forward(ws)

    try:
        with serving_app(front, ws="websockets-sansio") as url:
            yield url.replace("http", "ws", 1) + "/api/chat", sessions, loops, model.engine
    finally:
        app.state.close()


async def _closed(url: str) -> aiohttp.WSMessage:
    async with aiohttp.ClientSession() as s, s.ws_connect(url) as ws:
        async with asyncio.timeout(30):
            return await ws.receive()


def test_a_session_through_the_ingress_gets_the_handshake_and_its_frames(ingress):
    url, sessions, _, engine = ingress
    frames = 6
    result = asyncio.run(chat(url + GREEDY, SPEECH[:frames * F], timeout_s=60))
    assert result.first == b"\x00"
    assert result.kinds.count(1) == frames and set(result.kinds) <= {1, 2} and all(len(a) == F for a in result.audio)
    refused = asyncio.run(_closed(url + "?audio_topk=many"))  # the replica's close code and reason, passed on
    assert refused.data == 4400 and "audio_topk must be an integer" in refused.extra, refused
    wait_for(lambda: not sessions.sockets and engine.stats().in_flight == 0, what="the sessions to end")


def test_draining_refuses_new_sessions_and_closes_the_running_one_with_1012(ingress):
    url, sessions, loops, engine = ingress

    async def run() -> tuple[aiohttp.WSMessage, int, aiohttp.WSMessage]:
        async with aiohttp.ClientSession() as s, s.ws_connect(url) as ws:
            async with asyncio.timeout(60):
                assert (await ws.receive()).data == b"\x00"
                assert len(sessions.busy) == 1  # what the drain waits for: the session, as long as it lasts
                sessions.lifecycle.draining = True
                refused = await _closed(url)
                answered = 0
                for p in opus_frames(SPEECH[:4 * F]):  # the running session goes on
                    await ws.send_bytes(b"\x01" + p)
                while answered < 3:
                    answered += (await ws.receive()).data[0] == 1
                asyncio.run_coroutine_threadsafe(sessions.close_all("server restarting"), loops[0]).result(30)
                while (end := await ws.receive()).type == aiohttp.WSMsgType.BINARY:
                    pass
            return refused, answered, end

    try:
        refused, answered, end = asyncio.run(run())
    finally:
        sessions.lifecycle.draining = False
    assert refused.data == 1013 and "draining" in refused.extra, refused
    assert answered == 3
    assert end.type == aiohttp.WSMsgType.CLOSE and end.data == 1012 and end.extra == "server restarting", end
    wait_for(lambda: not sessions.busy and engine.stats().in_flight == 0, what="the session's request to end")
