"""A web page cannot drive a local server that has no API key: JSON routes take only
`application/json` (a cross-site page cannot send it without a preflight, which is never
granted), voice creation refuses other origins, `Host` must be the bind address or an allowed
name (DNS rebinding), and no response echoes `Host` (no trailing-slash redirect)."""
from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import httpx
import pytest
from api_helpers import MODEL, running_server
from speech_helpers import FISH, reference_wav

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def qwen(demo_cache):
    with running_server(demo_cache[0], "--allowed-hosts", "omnivox.internal") as (url, _, _):
        yield url


@pytest.fixture(scope="module")
def fish(fish_server):
    return fish_server[0], fish_server[2]


def raw(url: str, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, dict, bytes]:
    """One request with exactly these headers (Host included: no client-side defaults)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for k, v in {"Content-Length": str(len(body)), **headers}.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                  None])
def test_json_routes_refuse_other_content_types(qwen, fish, kind):
    host = urlsplit(qwen).netloc
    headers = {"Host": host, **({"Content-Type": kind} if kind else {})}
    status, _, reply = raw(qwen, "POST", "/v1/chat/completions", headers, json.dumps(CHAT).encode())
    assert status == 415 and json.loads(reply)["error"]["code"] == "unsupported_media_type", reply
    speech = {"model": FISH, "input": "hi", "response_format": "pcm", "max_frames": 3}
    status, _, reply = raw(fish[0], "POST", "/v1/audio/speech", {**headers, "Host": urlsplit(fish[0]).netloc},
                           json.dumps(speech).encode())
    assert status == 415 and b"application/json" in reply
    ok = httpx.post(qwen + "/v1/chat/completions", content=json.dumps(CHAT),
                    headers={"Content-Type": "application/json; charset=utf-8"}, timeout=60)
    assert ok.status_code == 200, ok.text


def _voice_form(name: str) -> tuple[bytes, str]:
    form = httpx.Request("POST", "http://x", data={"name": name, "consent": "c", "transcript": "a reference"},
                         files={"audio_sample": ("r.wav", reference_wav(), "audio/wav")})
    return form.read(), form.headers["content-type"]


@pytest.mark.parametrize("origin", [{"Origin": "http://evil.example"}, {"Origin": "null"},
                                    {"Sec-Fetch-Site": "cross-site"}, {"Origin": "http://127.0.0.1:1"}])
def test_cross_origin_voice_creation_writes_nothing(fish, origin):
    url, folder = fish
    before = sorted(folder.iterdir())  # the shared server's folder: other modules' voices may be there
    body, kind = _voice_form("pwned")
    status, _, reply = raw(url, "POST", "/v1/audio/voices", {"Host": urlsplit(url).netloc, "Content-Type": kind,
                                                             **origin}, body)
    assert status == 403 and json.loads(reply)["error"]["code"] == "cross_origin_refused", reply
    assert sorted(folder.iterdir()) == before
    # the same request with no Origin (a script, the openai client) or from the server's own origin works
    same = {"Origin": url}
    for extra, name in (({}, "mine"), (same, "mine2")):
        body, kind = _voice_form(name)
        status, _, reply = raw(url, "POST", "/v1/audio/voices", {"Host": urlsplit(url).netloc, "Content-Type": kind,
                                                                 **extra}, body)
        assert status == 200, reply
        assert httpx.delete(f"{url}/v1/audio/voices/{name}").status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.nip.io", "localhost.evil.example",
                                  "10.1.2.3"])
def test_foreign_host_is_refused_on_every_route(qwen, host):
    for method, path, body in (("GET", "/health", b""), ("GET", "/v1/models", b""),
                               ("POST", "/v1/chat/completions", json.dumps(CHAT).encode())):
        status, _, reply = raw(qwen, method, path, {"Host": host, "Content-Type": "application/json"}, body)
        assert status == 400 and json.loads(reply)["error"]["code"] == "invalid_host", (path, reply)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "LOCALHOST:1234", "omnivox.internal",
                                  "omnivox.internal:80"])
def test_own_and_allowed_hosts_are_served(qwen, host):
    status, _, reply = raw(qwen, "GET", "/v1/models", {"Host": host})
    assert status == 200 and json.loads(reply)["data"][0]["id"] == MODEL


@pytest.mark.parametrize("path", ["/v1/models/", "/v1/chat/completions/", "/health/", "/v1/audio/voices/"])
def test_no_redirect_echoes_host(qwen, path):
    host = urlsplit(qwen).netloc
    for method in ("GET", "POST"):
        status, headers, reply = raw(qwen, method, path, {"Host": host, "Content-Type": "application/json"},
                                     json.dumps(CHAT).encode() if method == "POST" else b"")
        assert "location" not in headers and 400 <= status < 500, (method, path, status, headers)
        assert host.encode() not in reply
