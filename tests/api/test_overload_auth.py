"""A server with --max-running 1 --max-queue 0 --api-key: the key is enforced on /v1 routes,
and a request over capacity gets 503 (OpenAI error shape, Retry-After) while service goes on."""
from __future__ import annotations

import httpx
import openai
import pytest
from api_helpers import MODEL, running_server, wait_for

KEY = "sk-test-omnivox"


@pytest.fixture(scope="module")
def server(demo_cache):
    with running_server(demo_cache[0], "--max-running", "1", "--max-queue", "0", "--api-key", KEY) as (url, _, _):
        yield url


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def small(c: openai.OpenAI):
    return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)


def in_flight(url: str) -> int:
    return httpx.get(url + "/health").json()["in_flight"]


def test_api_key_enforced(server):
    r = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError, match="not valid"):
        small(client(server, "sk-wrong"))
    assert httpx.get(server + "/health").status_code == 200  # probes stay open
    assert httpx.get(server + "/metrics").status_code == 200
    assert [m.id for m in client(server).models.list().data] == [MODEL]
    assert small(client(server)).choices[0].message.content is not None


def test_overload_then_normal_service(server):
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "Talk for a long time."}], "stream": True,
               "max_tokens": 3000, "max_audio_frames": 3000, "temperature": 0, "modalities": ["text", "audio"],
               "audio": {"voice": "ethan", "format": "pcm16"}}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server + "/v1/chat/completions", json=payload, headers=headers) as long:
            assert long.status_code == 200
            lines = long.iter_lines()  # NOTE: held: a dropped httpx line iterator closes the response
            next(lines)
            assert in_flight(server) == 1
            r = httpx.post(server + "/v1/chat/completions", headers=headers, timeout=60,
                           json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert err["code"] == "server_overloaded" and "max_running 1" in err["message"]
            with pytest.raises(openai.InternalServerError, match="server busy"):
                small(client(server))
            assert sum(1 for _ in zip(range(20), lines)) == 20  # the running stream is unharmed
    wait_for(lambda: in_flight(server) == 0, what="the disconnect to abort the stream")
    assert small(client(server)).choices[0].finish_reason in ("stop", "length")


def test_capacity_is_checked_before_the_body_is_read(server):
    """Over capacity, a request with a large declared body is refused without any of it sent."""
    import socket
    from urllib.parse import urlsplit
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "Talk for a long time."}], "stream": True,
               "max_tokens": 3000, "max_audio_frames": 3000, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}
    u = urlsplit(server)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server + "/v1/chat/completions", json=payload, headers=headers) as long:
            lines = long.iter_lines()  # NOTE: held: a dropped httpx line iterator closes the response
            next(lines)
            with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
                sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.netloc}\r\nAuthorization: Bearer {KEY}"
                              f"\r\nContent-Type: application/json\r\nContent-Length: {30 * 2**20}\r\n\r\n").encode())
                reply = b""
                while b"\r\n\r\n" not in reply:  # the reply comes though not one body byte was sent
                    reply += sock.recv(65536)
            assert reply.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in reply.lower(), reply[:300]
    # the server learns of the closed stream asynchronously: its slot is free once it aborted it
    wait_for(lambda: in_flight(server) == 0, what="the disconnect to abort the stream")
    assert small(client(server)).choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("how", ["file", "env"])
def test_api_key_from_a_file_or_the_environment(demo_cache, tmp_path, monkeypatch, how):
    key = "sk-from-" + how
    if how == "file":
        path = tmp_path / "key"
        path.write_text(key + "\n")
        args = ("--api-key-file", str(path))
    else:
        monkeypatch.setenv("OMNIVOX_API_KEY", key)
        args = ()
    with running_server(demo_cache[0], *args) as (url, proc, _):
        cmdline = open(f"/proc/{proc.pid}/cmdline", "rb").read()
        assert key.encode() not in cmdline  # not visible in the process list
        assert httpx.get(url + "/v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            small(client(url, "sk-wrong"))
        assert [m.id for m in client(url, key).models.list().data] == [MODEL]
