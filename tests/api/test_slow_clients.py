"""Slow clients cannot hold the server: a request's headers and body have deadlines
(--header-timeout, --body-timeout: 408 and the connection closed), and bodies being received
are bounded in memory (--max-pending-body-mb: 503 before the body is read) while /health and
ordinary requests go on being served."""
from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
from api_helpers import MODEL, running_server

HEADER_S, BODY_S = 1, 3
STALLED, BODY_MB, SENT_MB, PENDING_MB = 10, 30, 29, 64


@pytest.fixture(scope="module")
def server(demo_cache):
    with running_server(demo_cache[0], "--header-timeout", str(HEADER_S), "--body-timeout", str(BODY_S),
                        "--max-body-mb", "32", "--max-pending-body-mb", str(PENDING_MB)) as (url, proc, _):
        yield url, proc


def _connect(url: str) -> socket.socket:
    u = urlsplit(url)
    return socket.create_connection((u.hostname, u.port), timeout=30)


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
