"""Slow clients cannot hold the server: a request's headers and body have deadlines
(--header-timeout, --body-timeout: 408 and the connection closed), bodies being received
are bounded in memory (--max-pending-body-mb: 503 before the body is read), and a client that
stops reading its streamed reply is dropped (--stream-send-timeout-s: the connection aborted, the
request cancelled, the drop counted), while /health and ordinary requests go on being served."""
from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
from api_helpers import MODEL, metric, running_server, wait_for

HEADER_S, BODY_S, SEND_S = 1, 3, 1
STALLED, BODY_MB, SENT_MB, PENDING_MB = 10, 30, 29, 64
DROPPED = "omnivox_slow_readers_dropped_total"


@pytest.fixture(scope="module")
def server(demo_cache):
    with running_server(demo_cache[0], "--header-timeout", str(HEADER_S), "--body-timeout", str(BODY_S),
                        "--max-body-mb", "32", "--max-pending-body-mb", str(PENDING_MB),
                        "--stream-send-timeout-s", str(SEND_S)) as (url, proc, _):
        yield url, proc


def _connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    """A client socket; `rcvbuf`: a small receive buffer (set before connecting, so the window is
    small), so a client that stops reading fills the server's side quickly."""
    u = urlsplit(url)
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect((u.hostname, u.port))
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def _head(url: str, length: int) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {urlsplit(url).netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def _rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _assert_serving(url: str) -> None:
    start = time.monotonic()
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert time.monotonic() - start < 2.0  # answered at once (~0.04 s quiet), not behind the slow clients
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"])
def test_silent_or_slow_headers_are_cut(server, sent):
    url, _ = server
    with _connect(url) as sock:
        sock.sendall(sent)
        start = time.monotonic()
        for _ in range(10):  # trickle a header byte now and then: each byte does not extend the deadline
            try:
                sock.sendall(b"X")
            except OSError:
                break
            time.sleep(0.3)
        sock.settimeout(HEADER_S + 10)
        assert _read_all(sock) == b""  # closed by the server, no reply
        assert time.monotonic() - start < HEADER_S + 10
    _assert_serving(url)


def test_stalled_body_gets_408_and_the_connection_closed(server):
    url, _ = server
    with _connect(url) as sock:
        sock.sendall(_head(url, 1000) + b'{"model": ')
        sock.settimeout(BODY_S + 20)
        reply = _read_all(sock)  # ends: the server closed the connection after its reply
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    assert b"connection: close" in reply.lower() and b"request_timeout" in reply and b"--body-timeout" in reply
    _assert_serving(url)


def test_stalled_large_bodies_stay_bounded_in_memory(server):
    url, proc = server
    before = _rss_mb(proc.pid)
    peak, replies = [before], [b""] * STALLED
    chunk = b" " * 2**20

    def stall(i: int) -> None:
        with _connect(url) as sock:
            try:
                sock.sendall(_head(url, BODY_MB * 2**20))
                for _ in range(SENT_MB):
                    sock.sendall(chunk)
            except OSError:  # refused and closed before we finished: the reply is waiting
                pass
            sock.settimeout(BODY_S + 30)
            try:
                replies[i] = _read_all(sock)
            except OSError:
                pass

    threads = [threading.Thread(target=stall, args=(i,)) for i in range(STALLED)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak.append(_rss_mb(proc.pid))
        time.sleep(0.05)
    for t in threads:
        t.join()
    statuses = sorted(r[9:12].decode() for r in replies)
    assert set(statuses) <= {"408", "503"} and statuses.count("408") <= PENDING_MB // BODY_MB, statuses
    assert statuses.count("503") >= STALLED - PENDING_MB // BODY_MB, statuses
    # unbounded, 10 x 29 MB = 290 MB were held; bounded, at most 2 bodies (with copies) are
    assert max(peak) - before < 2.5 * PENDING_MB, (before, max(peak))
    _assert_serving(url)


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=30).text


def _dropped(text: str) -> float:
    try:
        return metric(text, DROPPED, api="http", reason="send_timeout")
    except KeyError:  # no sample before the first drop
        return 0.0


def test_a_client_that_stops_reading_its_stream_is_dropped(server):
    """A raw client asks for a streamed reply of about 10 MB (2000 speech frames as base64 pcm) and
    never reads it: once the socket's buffers are full, a send waits --stream-send-timeout-s and
    the connection is aborted, its request cancelled (pages freed), the drop counted."""
    url, _ = server
    before = _metrics(url)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
                       "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"},
                       "stream": True, "max_tokens": 8, "ignore_eos": True, "max_audio_frames": 2000}).encode()
    with _connect(url, rcvbuf=4096) as sock:
        sock.sendall(_head(url, len(body)) + body)
        # a bound for liveness only: the buffers fill after ~200 KB of the reply
        wait_for(lambda: _dropped(_metrics(url)) > _dropped(before), timeout=240, what="the deaf client's drop")
        wait_for(lambda: metric(_metrics(url), "omnivox_requests_in_flight") == 0, what="its request to end")
        after = _metrics(url)  # (an abort is counted before its request leaves the in-flight count)
        sock.settimeout(30)
        reply = _read_all(sock)  # what the kernel held for it, then the abort
    aborted = "omnivox_engine_requests_aborted_total"
    assert metric(after, aborted) > metric(before, aborted) and _dropped(after) == _dropped(before) + 1
    assert reply.startswith(b"HTTP/1.1 200 ") and b"text/event-stream" in reply[:500], reply[:300]
    assert b"[DONE]" not in reply and len(reply) < 8 * 2**20, len(reply)  # cut well before its end
    _assert_serving(url)
