"""Runs omnivox's own ASGI app (`Front` over `create_app`) inside an engine replica for requests
that arrived at the ingress: what the ASGI server would do, driven by handle calls instead of a
socket. Everything sent back is plain data (dicts, bytes) that Ray pickles.

HTTP (`http_exchange`): one streaming call per request. The app reads the whole body at once,
then `receive` blocks until the call is closed (the client went away: Serve cancels the call),
when it answers `http.disconnect`, as uvicorn would. The call yields the response start
`{"status", "headers"}` (with `x-omnivox-replica`), then each body chunk.

WebSocket (`Socket`): one streaming call carries what the app sends for one session (accept,
text and bytes, close); each client message arrives through `Socket.put` (a unary call pinned to
the same replica). `session.created` and `session.updated` events get `session.omnivox.replica`."""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from starlette.types import ASGIApp, Message

REPLICA_HEADER = "x-omnivox-replica"
SCOPE_KEYS = ("type", "http_version", "method", "scheme", "path", "raw_path", "root_path", "query_string",
              "headers", "client", "server", "subprotocols")


def plain_scope(scope: dict) -> dict:
    """The parts of an ASGI scope that travel to a replica (no app, router or state objects)."""
    out = {k: scope[k] for k in SCOPE_KEYS if k in scope}
    out["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])]
    out["root_path"] = ""
    out["asgi"] = {"version": "3.0", "spec_version": "2.3"}
    return out


async def _run_app(app: ASGIApp, scope: dict, receive, out: asyncio.Queue) -> None:
    try:
        await app(scope, receive, out.put)
    finally:
        await out.put(None)  # the app returned (or failed): nothing more comes


async def http_exchange(app: ASGIApp, scope: dict, body: bytes, replica: str) -> AsyncIterator[dict | bytes]:
    """One HTTP request through `app`: yields {"status", "headers"}, then the body's chunks."""
    gone, sent_body = asyncio.Event(), False

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    out: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(_run_app(app, scope, receive, out))
    started = False
    try:
        while (msg := await out.get()) is not None:
            if msg["type"] == "http.response.start":
                started = True
                headers = [(bytes(k), bytes(v)) for k, v in msg.get("headers", [])]
                yield {"status": msg["status"], "headers": headers + [(REPLICA_HEADER.encode(), replica.encode())]}
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield bytes(msg["body"])
                if not msg.get("more_body", False):
                    return
        if not started:  # the app returned without answering (it raised): as uvicorn, a 500
            yield {"status": 500, "headers": [(b"content-type", b"text/plain"), (REPLICA_HEADER.encode(), replica.encode())]}
            yield b"Internal Server Error"
        else:
            raise RuntimeError("the response ended before its body did")  # the ingress cuts the stream
    finally:
        gone.set()
        try:
            async with asyncio.timeout(5):
                await asyncio.shield(task)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the app's own failure was already answered
            task.cancel()


class Socket:
    """One realtime session's WebSocket, held by the replica that runs it."""

    def __init__(self, app: ASGIApp, scope: dict, replica: str):
        self.app, self.scope, self.replica = app, scope, replica
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.inbox.put_nowait({"type": "websocket.connect"})

    def put(self, message: dict) -> None:
        """A client message (`websocket.receive` or `websocket.disconnect`)."""
        self.inbox.put_nowait(message)

    async def run(self) -> AsyncIterator[dict]:
        """What the app sends, until it closes the socket or returns."""
        out: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(_run_app(self.app, self.scope, self.inbox.get, out))
        try:
            while (msg := await out.get()) is not None:
                yield self._tagged(msg)
                if msg["type"] == "websocket.close":
                    return
        finally:
            self.inbox.put_nowait({"type": "websocket.disconnect", "code": 1006})
            try:
                async with asyncio.timeout(5):
                    await asyncio.shield(task)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the session is over either way
                task.cancel()

    def _tagged(self, msg: dict) -> dict:
        text = msg.get("text")
        if msg["type"] != "websocket.send" or not text or '"session.' not in text[:200]:
            return msg
        event = json.loads(text)
        if event.get("type") in ("session.created", "session.updated") and isinstance(event.get("session"), dict):
            ext = event["session"].get("omnivox")
            event["session"]["omnivox"] = {**(ext if isinstance(ext, dict) else {}), "replica": self.replica}
            msg = {**msg, "text": json.dumps(event, ensure_ascii=False)}
        return msg
