"""Smaller hostile-input findings against a server on loopback: local-media errors that mapped the
server's files, a cut body or an over-long number logged as a server error, a frameable playground,
keys in query strings written to the access log, and a rebound host name passing the realtime
Origin check under `--allowed-hosts '*'`."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket

import httpx
import pytest
import torch
import websockets

from omnivox import Omni
from omnivox.api.guards import HostPolicy
from realtime_helpers import MODEL, live_server, wait_for

BIG = "1" + "0" * 5000  # past Python's 4,300-digit int-string limit


class Records(logging.Handler):
    """Every record the named loggers emit at DEBUG and above, while in use."""

    def __init__(self, *names: str):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.loggers = [logging.getLogger(n) for n in names]

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self):
        self.levels = [lg.level for lg in self.loggers]
        for lg in self.loggers:
            lg.addHandler(self)
            lg.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc):
        for lg, level in zip(self.loggers, self.levels):
            lg.removeHandler(self)
            lg.setLevel(level)

    def text(self) -> str:
        return "\n".join(r.getMessage() + (" TRACEBACK" if r.exc_info else "") for r in self.records)


@pytest.fixture(scope="module")
def omni(demo_cache):
    torch.set_num_threads(1)
    o = Omni(model=demo_cache[1], progress=False)
    yield o
    o.close()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """(DIR, outside folder): DIR holds a directory and a symlink to an existing file outside it."""
    top = tmp_path_factory.mktemp("hostile-media")
    root, outside = top / "allowed", top / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.wav").write_bytes(b"RIFF" + b"\0" * 64)
    (root / "sub").mkdir()
    os.symlink(outside / "secret.wav", root / "link.wav")
    return root, outside


@pytest.fixture(scope="module")
def server(omni, media):
    """The demo model served with --allowed-hosts '*' and --allowed-local-media-path DIR."""
    with live_server(omni, hosts=HostPolicy("127.0.0.1", ["*"]), media_dir=media[0]) as (url, app):
        yield url


def chat_error(url: str, media_url: str) -> dict:
    part = {"type": "audio_url", "audio_url": {"url": media_url}}
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [part, {"type": "text",
                                                                                       "text": "Hi"}]}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_local_media_refusals_are_one_message_without_the_folder(server, media):
    root, outside = media
    refs = {"exists outside": str(outside / "secret.wav"), "missing outside": str(outside / "nothing.wav"),
            "missing inside": "nothing.wav", "dotdot to an existing file": "../outside/secret.wav",
            "a directory": "sub", "a symlink out": "link.wav", "file:// outside": f"file://{outside}/secret.wav"}
    shapes = {}
    for what, ref in refs.items():
        err = chat_error(server, ref)
        assert err["param"] == "messages[0].content[0].audio_url.url", (what, err)  # still names the field
        assert str(root) not in err["message"], (what, err)
        shapes[what] = (err["message"].replace(repr(ref)[:200], "<ref>"), err["code"])
    assert len(set(shapes.values())) == 1, shapes  # "exists outside" reads exactly as "missing"
    assert "not a readable file under --allowed-local-media-path" in shapes["missing inside"][0]


def test_cut_body_and_overlong_number_are_not_server_errors(server, capfd):
    def chat_total() -> float:
        text = httpx.get(server + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("omnivox_http_requests_total{") and '"/v1/chat/completions"' in line)

    with Records("uvicorn", "uvicorn.error", "omnivox") as logs:
        before = chat_total()
        port = int(server.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as s:  # promises 1000 bytes, sends 10, leaves
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"model\":")
        wait_for(lambda: chat_total() > before, what="the cut request to finish")
        for body in ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0},
                     {"model": MODEL, "input": "Hi", "speed": 0}):
            path = "/v1/chat/completions" if "messages" in body else "/v1/audio/speech"
            raw = json.dumps(body).replace(": 0}", f": {BIG}}}")
            r = httpx.post(server + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
            assert r.status_code == 400, r.text

        async def realtime() -> dict:
            async with websockets.connect(server.replace("http", "ws", 1) + "/v1/realtime") as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"
                await ws.send('{"type": "session.update", "session": {"max_output_tokens": %s}}' % BIG)
                return json.loads(await asyncio.wait_for(ws.recv(), 30))

        event = asyncio.run(realtime())
        assert event["type"] == "error" and "too long" in event["error"]["message"], event
        assert event["error"]["code"] == "invalid_json", event
    bad = [r for r in logs.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not bad, logs.text()
    assert "Traceback" not in capfd.readouterr().err


def test_playground_cannot_be_framed(server):
    r = httpx.get(server + "/playground")
    assert r.status_code == 200 and "<script" in r.text
    csp = r.headers["content-security-policy"]
    assert "frame-ancestors 'self'" in csp and "default-src 'self'" in csp, csp
    assert r.headers["x-frame-options"] in ("DENY", "SAMEORIGIN")
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["referrer-policy"] == "no-referrer"


def test_query_string_keys_never_reach_the_log(server):
    from omnivox.api import access_log
    access_log.install()
    secret = "sk-hostile-9f8e7d"
    with Records("uvicorn.access", "uvicorn.error") as logs:
        for query in (f"api_key={secret}", f"key={secret}&x=1", f"a=1&access_token={secret}",
                      f"openai-insecure-api-key={secret}", f"token={secret}"):
            assert httpx.get(f"{server}/v1/models?{query}").status_code == 200

        async def realtime() -> None:
            async with websockets.connect(server.replace("http", "ws", 1) + f"/v1/realtime?api_key={secret}") as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"

        asyncio.run(realtime())
        wait_for(lambda: sum("/v1/models" in r.getMessage() for r in logs.records) >= 5
                 and any("WebSocket" in r.getMessage() for r in logs.records), what="the access lines")
    text = logs.text()
    assert secret not in text, text
    assert "x=1" in text and "api_key=***" in text, text  # the rest of the line stays


def test_rebound_name_is_not_the_servers_own_origin(server):
    port = int(server.rsplit(":", 1)[1])

    async def first(host: str) -> str:
        """The first event, or the close code and reason, of a page on `host` (resolved to loopback)."""
        uri = f"ws://{host}:{port}/v1/realtime"
        try:
            async with websockets.connect(uri, host="127.0.0.1", port=port, origin=f"http://{host}:{port}") as ws:
                return json.loads(await asyncio.wait_for(ws.recv(), 30))["type"]
        except websockets.ConnectionClosed as e:
            return f"{e.rcvd.code} {e.rcvd.reason}"

    refused = asyncio.run(first("evil.example"))
    assert refused.startswith("4403") and "--allowed-origins" in refused, refused
    assert asyncio.run(first("127.0.0.1")) == "session.created"  # the playground's own origin still works
    assert asyncio.run(first("localhost")) == "session.created"


def test_a_rebound_name_is_not_the_servers_own_origin_over_http():
    """The same rule for state-changing HTTP requests (voice creation) without --api-key."""
    from omnivox.api.guards import HostPolicy, check_origin

    def page(name: str, policy: HostPolicy):
        host = f"{name}:8000".encode()
        return check_origin({b"host": host, b"origin": b"http://" + host, b"sec-fetch-site": b"same-origin"}, policy)

    anything = HostPolicy("127.0.0.1", ["*"])
    refused = page("evil.example", anything)
    assert refused is not None and refused.status == 403
    assert page("127.0.0.1", anything) is None and page("localhost", anything) is None
    assert page("omni.example.com", HostPolicy("0.0.0.0", ["omni.example.com"])) is None  # a name the operator listed
