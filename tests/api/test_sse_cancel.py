"""A streamed reply whose client goes away is closed at once, even when the disconnect lands as a
write completes: before Python 3.12, `asyncio.wait_for` returned the finished write's result to a
task cancelled at that moment, the cancellation was lost, and the stream (and its request) went on
until the reply ended (the intermittent `test_disconnect_mid_stream_frees_pages` failure)."""
from __future__ import annotations

import asyncio

from omnivox.api.streaming import SEND_LIMIT, SendLimit, SSEResponse


def test_a_disconnect_as_a_write_completes_closes_the_stream():
    async def run() -> tuple[list[str], int]:
        gone = asyncio.Event()
        never = asyncio.Event()
        closed: list[str] = []
        sent = [0]

        async def body():
            yield b"data: 1\n\n"
            await never.wait()  # a reply that goes on (the engine still has tokens to send)
            yield b"data: 2\n\n"

        async def send(message):
            if message["type"] == "http.response.body":
                sent[0] += 1
                gone.set()  # the client leaves while this write is in flight
                await asyncio.sleep(0)  # the write completes a loop turn later

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        response = SSEResponse(body(), on_close=lambda: closed.append("closed"))
        scope = {"type": "http", SEND_LIMIT: SendLimit(30.0, None, lambda: None)}
        await asyncio.wait_for(response(scope, receive, send), 10)
        return closed, sent[0]

    closed, sent = asyncio.run(run())
    assert closed == ["closed"] and sent == 1


def test_no_wait_for_in_the_package():
    """The same race anywhere a cancelled task must stop (a realtime send, a body read): every
    bounded await in omnivox is `asyncio.timeout`."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "omnivox"
    users = [str(p.relative_to(root)) for p in root.rglob("*.py") if "asyncio.wait_for(" in p.read_text()]
    assert users == []
