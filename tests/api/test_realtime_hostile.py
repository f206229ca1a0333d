"""`/v1/realtime` under hostile clients: sizes are checked before any work, large messages are
parsed without stopping the server, and session.update refuses what response.create would.

Each test watches the server's liveness from outside (`/health` polled over HTTP meanwhile): the
server runs in a thread of this process, but its event loop is what every route and session shares.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import torch
import websockets

from omnivox import Omni
from omnivox.engine.config import EngineConfig
from omnivox.models.qwen3_omni.options import MAX_TALKER_INSTRUCTION_CHARS
from realtime_helpers import live_server, recv_until, ws_url

LIVE_S = 2.0  # a /health answer slower than this means the event loop stopped (quiet: a few ms)


@pytest.fixture(scope="module")
def omni(demo_cache):
    torch.set_num_threads(1)
    o = Omni(model=demo_cache[1], progress=False, engine_config=EngineConfig(max_running=4, max_queue=4))
    yield o
    o.close()


class Health:
    """Polls `/health` until stopped; `worst` is the slowest answer seen."""

    def __init__(self, url: str):
        self.url, self.worst, self.polls = url, 0.0, 0
        self._stop = asyncio.Event()
        self.task = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            while not self._stop.is_set():
                t = time.monotonic()
                assert (await client.get(self.url + "/health")).status_code == 200
                self.worst, self.polls = max(self.worst, time.monotonic() - t), self.polls + 1
                await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self._stop.set()
        await self.task
        assert self.polls >= 2 and self.worst < LIVE_S, f"/health took {self.worst:.2f} s ({self.polls} polls)"


def text_item(text: str) -> str:
    return json.dumps({"type": "conversation.item.create",
                       "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})


def test_oversized_text_is_refused_before_tokenizing(omni):
    """A 4 MB text item (or instructions) cannot fit the demo's 4096-token context: refused with
    input_too_long before it is tokenized (unfixed: tokenized on the event loop, seconds), the
    session goes on and keeps its settings."""
    big = "word " * 800_000

    async def run(url):
        async with websockets.connect(ws_url(url), max_size=None) as ws:
            await recv_until(ws, "session.created")
            health = Health(url)
            await ws.send(text_item(big))
            err = (await recv_until(ws, "error", "conversation.item.done"))[-1]
            assert err["type"] == "error" and err["error"]["code"] == "input_too_long", err
            assert err["error"]["param"] == "item.content"
            await ws.send(json.dumps({"type": "session.update", "session": {"instructions": big}}))
            err = (await recv_until(ws, "error", "session.updated"))[-1]
            assert err["type"] == "error" and err["error"]["code"] == "input_too_long", err
            assert err["error"]["param"] == "session.instructions"
            await ws.send(json.dumps({"type": "response.create", "response": {"instructions": big}}))
            err = (await recv_until(ws, "error", "response.created"))[-1]
            assert err["type"] == "error" and err["error"]["code"] == "input_too_long", err
            await health.stop()
            await ws.send(text_item("hello"))  # the session goes on
            added = await recv_until(ws, "conversation.item.done")
            assert not [e for e in added if e["type"] == "error"]
            await ws.send(json.dumps({"type": "session.update", "session": {}}))
            assert (await recv_until(ws, "session.updated"))[-1]["session"]["instructions"] == ""

    with live_server(omni) as (url, _):
        asyncio.run(run(url))


def test_many_valued_message_is_refused_without_stalling(omni):
    """Two ~12 MiB session.update messages of a million keys each, from two clients at once: refused
    (invalid_event) by a scan that runs at string speed; unfixed, each is parsed whole (~1 s with the
    GIL held: every session and route waits) and then applied. `/health` stays live meanwhile."""
    fields = {f"k{i}": 0 for i in range(1_000_000)}
    message = json.dumps({"type": "session.update", "session": {"omnivox": {}, **fields}})
    assert len(message) < 15 * 2**20

    async def client(url):
        async with websockets.connect(ws_url(url), max_size=None) as ws:
            await recv_until(ws, "session.created")
            await ws.send(message)
            err = (await recv_until(ws, "error", "session.updated"))[-1]
            assert err["type"] == "error" and err["error"]["code"] == "invalid_event", err
            await ws.send(json.dumps({"type": "session.update", "session": {}}))
            await recv_until(ws, "session.updated")

    async def run(url):
        health = Health(url)
        await asyncio.gather(client(url), client(url))
        await health.stop()

    with live_server(omni) as (url, _):
        asyncio.run(run(url))


@pytest.mark.parametrize("ext, code", [
    ({"top_p": 0}, "invalid_value"),
    ({"talker_instruction": "x" * (MAX_TALKER_INSTRUCTION_CHARS + 1)}, "input_too_long"),
])
def test_session_update_refuses_what_response_create_would(omni, ext, code):
    """Settings that response.create refuses are refused by session.update, with the same code;
    the session keeps its settings."""
    async def run(url):
        async with websockets.connect(ws_url(url), max_size=None) as ws:
            await recv_until(ws, "session.created")
            await ws.send(json.dumps({"type": "session.update", "session": {"omnivox": ext}}))
            err = (await recv_until(ws, "error", "session.updated"))[-1]
            assert err["type"] == "error" and err["error"]["code"] == code, err
            await ws.send(json.dumps({"type": "response.create", "response": {"omnivox": ext}}))
            err2 = (await recv_until(ws, "error", "response.created"))[-1]
            assert err2["type"] == "error" and err2["error"]["code"] == code, err2
            await ws.send(json.dumps({"type": "session.update", "session": {}}))
            kept = (await recv_until(ws, "session.updated"))[-1]["session"]["omnivox"]
            assert kept["top_p"] is None and kept["talker_instruction"] is None

    with live_server(omni) as (url, _):
        asyncio.run(run(url))
