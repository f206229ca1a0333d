"""`omnivox serve --replicas` is safe by default, on the shared application (conftest.py's
`cluster`: Ray started as the launcher starts its own): Ray refuses every caller without its
token and listens on loopback but for Serve's token-guarded inter-replica ports; the ingress
makes `omnivox serve`'s checks before it reads a body (a slow body: 408 at --body-timeout;
keyless 40 MB bodies: 401 before they are read; bodies past --max-pending-body-mb: 503); the
turns of a conversation keep their replica. Every client is bounded in time."""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx

from api_helpers import wait_for
from process_tree import LOOPBACK, listeners, rss
from ray_helpers import call_without_token
from shared_cluster import BODY_TIMEOUT_S, KEY, MAX_PENDING_BODY_MB, MODEL

REPLICA = "x-omnivox-replica"
MB = 2**20
WAIT_S = 90.0
CONVERSATIONS = 20
GCS, RAYLET = "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo", "/ray.rpc.NodeManagerService/GetNodeStats"
WORKER, SERVE = "/ray.rpc.CoreWorkerService/NumPendingTasks", "/ray.serve.ASGIService/HandleRequest"


def _address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _loopback(ip: str) -> bool:
    return ip in LOOPBACK or ip == "::ffff:127.0.0.1"


def test_ray_listens_on_loopback_and_refuses_every_caller_without_its_token(cluster, tmp_path):
    import ray
    found = listeners(os.getpid())  # this process (Ray's driver here) and its Ray instance
    print("listening:", *found, sep="\n  ")
    node = ray.nodes()[0]
    # -1: the agent's HTTP server found its fixed port taken (Ray's log: "Agent port #52365 failed to bind")
    assert node["DashboardAgentListenPort"] > 0, "no dashboard agent HTTP port: does another Ray here hold 52365?"
    calls = [[ray.get_runtime_context().gcs_address, GCS], [_address("127.0.0.1", node["NodeManagerPort"]), RAYLET]]
    for x in found:
        if not _loopback(x.ip):  # Serve 2.60 binds each replica's inter-replica gRPC server to [::] itself
            assert "ray::ServeReplica" in x.process and x.ip in ("::", "0.0.0.0"), f"{x} faces the network"
            calls.append([_address("127.0.0.1", x.port), SERVE])
        elif x.process.startswith("ray::ServeReplica"):  # each replica's own Ray worker server
            calls.append([_address(x.ip, x.port), WORKER])
    assert any(method == SERVE for _, method in calls) and any(method == WORKER for _, method in calls)
    jobs = f"http://127.0.0.1:{node['DashboardAgentListenPort']}/api/job_agent/jobs/"
    refused = call_without_token({"grpc": calls, "jobs": jobs}, tmp_path)
    print("without the token:", list(zip([m.rsplit("/", 1)[1] for _, m in calls], refused["grpc"])), refused["jobs"])
    assert refused["grpc"] == ["UNAUTHENTICATED"] * len(calls) and refused["jobs"] == 401
    # the control: the same calls with the instance's token get through
    allowed = call_without_token({"grpc": calls}, tmp_path, token=os.environ["RAY_AUTH_TOKEN"])
    assert allowed["grpc"][:2] == ["OK", "OK"] and "UNAUTHENTICATED" not in allowed["grpc"], allowed


def test_its_own_instance_gives_serves_proxy_30_s_per_ready_check(cluster):
    """What Ray's processes see (Serve's controller reads it): a proxy slow to start on a busy
    machine is not killed after 5 s and restarted in a loop (ray_cluster.start_own)."""
    import ray
    from omnivox.replicas.ray_cluster import PROXY_READY
    seen = ray.get(ray.remote(num_cpus=0)(lambda: os.environ.get(PROXY_READY)).remote(), timeout=WAIT_S)
    assert seen == "30"


# ---- the ingress's gate --------------------------------------------------------------------------
def _connect(url: str) -> socket.socket:
    u = urlsplit(url)
    return socket.create_connection((u.hostname, u.port), timeout=30)


def _head(url: str, length: int, key: bool = True) -> bytes:
    auth = f"Authorization: {KEY['Authorization']}\r\n" if key else ""
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {urlsplit(url).netloc}\r\nContent-Type: application/json\r\n"
            f"{auth}Content-Length: {length}\r\n\r\n").encode()


def _reply(sock: socket.socket, timeout: float = WAIT_S) -> tuple[int, dict, bytes]:
    """(status, headers, body) of the response on `sock`, read until its body is complete."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed without a reply: {data[:200]!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        assert chunk, "closed mid-reply"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _error(body: bytes) -> dict:
    return json.loads(body)["error"]


def test_the_ingress_refuses_as_omnivox_serve_does_before_reading_the_body(cluster):
    """Each request announces 40 MB and sends one byte: the refusal comes at once, the body unread
    (the old ingress read bodies first: no answer at all)."""
    url, _ = cluster
    cases = [({"Host": "evil.example"}, 400, "invalid_host"),
             ({"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
             ({"Content-Length": str(49 * MB)}, 413, "request_too_large")]  # past --max-body-mb 48
    for headers, status, code in cases:
        head = _head(url, 40 * MB).decode().split("\r\n")
        for name, value in headers.items():
            head = [f"{name}: {value}" if line.lower().startswith(name.lower() + ":") else line for line in head]
        with _connect(url) as sock:
            sock.sendall("\r\n".join(head).encode() + b"{")
            got, _, body = _reply(sock, timeout=BODY_TIMEOUT_S + 30)
        assert (got, _error(body)["code"]) == (status, code), body[:300]


def test_a_body_sent_at_1_byte_per_second_gets_408_at_its_deadline(cluster):
    url, _ = cluster
    replied = threading.Event()
    with _connect(url) as sock:
        sock.sendall(_head(url, 1000) + b"{")
        start = time.monotonic()

        def trickle() -> None:  # 1 byte a second, until the reply (or 60 s: the old ingress never answered)
            while not replied.wait(1.0) and time.monotonic() - start < 60:
                try:
                    sock.sendall(b" ")
                except OSError:
                    return

        sender = threading.Thread(target=trickle)
        sender.start()
        try:
            status, headers, body = _reply(sock, timeout=70)
        finally:
            replied.set()
            sender.join()
        took = time.monotonic() - start
    print(f"408 after {took:.1f} s (--body-timeout {BODY_TIMEOUT_S})")
    assert status == 408 and headers.get("connection") == "close", (status, headers, body)
    assert _error(body)["code"] == "request_timeout" and "--body-timeout" in _error(body)["message"]
    assert BODY_TIMEOUT_S <= took < BODY_TIMEOUT_S + 30


def _flood(url: str, clients: int, size: int, key: bool) -> list[tuple[int, dict, bytes, int]]:
    """`clients` requests at once, each sending a `size`-byte body as fast as the server takes it
    and stopping at the reply: (status, headers, body, bytes sent) each."""
    out: list = [None] * clients

    def one(i: int) -> None:
        with _connect(url) as sock:
            sock.sendall(_head(url, size, key))
            sock.setblocking(False)
            chunk, sent, got = b" " * MB, 0, b""
            deadline = time.monotonic() + WAIT_S
            while sent < size and not got and time.monotonic() < deadline:
                try:
                    got = sock.recv(65536, socket.MSG_PEEK)
                except BlockingIOError:
                    pass
                try:
                    sent += sock.send(chunk[:size - sent])
                except BlockingIOError:
                    time.sleep(0.002)
                except OSError:
                    break
            sock.setblocking(True)
            out[i] = (*_reply(sock), sent)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S + 30)
    return out


def test_keyless_bodies_are_refused_before_they_are_read(cluster):
    url, _ = cluster
    before = peak = rss(os.getpid(), children_only=True)  # Ray's processes (this one is the client)
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.05):
            peak = max(peak, rss(os.getpid(), children_only=True))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        replies = _flood(url, 8, 40 * MB, key=False)
    finally:
        done.set()
        sampler.join()
    print(f"Ray's processes: {before / MB:.0f} MB, peak +{(peak - before) / MB:.0f} MB; sent before the answer "
          f"(MB): {[r[3] // MB for r in replies]}")
    for status, _, body, _ in replies:
        assert status == 401 and _error(body)["code"] == "invalid_api_key", (status, body[:300])
        assert _error(body)["message"].startswith("no API key was given")
    assert peak - before < 100 * MB  # the old ingress read them first: +1.7 GB at peak


def test_bodies_past_the_pending_budget_get_503_before_they_are_read(cluster):
    url, _ = cluster
    fits = MAX_PENDING_BODY_MB // 40  # 2 bodies of 40 MB; the others get 503 at once
    socks = [_connect(url) for _ in range(4)]
    try:
        for s in socks:
            s.sendall(_head(url, 40 * MB) + b"{")  # and then nothing: each holds 40 MB of the budget
        answers: dict[int, tuple] = {}

        def refused_at_once() -> bool:
            for i, s in enumerate(socks):
                if i not in answers:
                    s.settimeout(0.05)
                    try:
                        if s.recv(1, socket.MSG_PEEK):
                            answers[i] = _reply(s)
                    except (TimeoutError, BlockingIOError):
                        pass
            return len(answers) >= len(socks) - fits

        wait_for(refused_at_once, WAIT_S, f"{len(socks) - fits} requests refused")
        for status, headers, body in answers.values():
            assert status == 503 and headers.get("retry-after") == "1", (status, body[:300])
            assert _error(body)["code"] == "server_overloaded" and "--max-pending-body-mb" in _error(body)["message"]
        held = [s for i, s in enumerate(socks) if i not in answers]
        assert len(held) == fits
        assert [_reply(s)[0] for s in held] == [408] * fits  # their bodies never came
    finally:
        for s in socks:
            s.close()
    # ... and the budget is whole again: 40 MB more are taken (then 408: no body follows)
    with _connect(url) as s:
        s.sendall(_head(url, 40 * MB) + b"{")
        assert _reply(s)[0] == 408


# ---- conversations keep their replica ------------------------------------------------------------
def _ask(http: httpx.Client, url: str, messages: list, headers: dict | None = None, **extra) -> str:
    r = http.post(url + "/v1/chat/completions", headers={**KEY, **(headers or {})},
                  json={"model": MODEL, "messages": messages, "max_tokens": 1, "modalities": ["text"], **extra})
    assert r.status_code == 200, r.text
    return r.headers[REPLICA]


def test_the_second_turn_of_a_conversation_goes_to_the_first_turns_replica(cluster):
    url, _ = cluster
    system = {"role": "system", "content": "You answer in one word."}

    def conversation(http: httpx.Client, i: int) -> tuple[str, str]:
        turn = [system, {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]
        first = _ask(http, url, turn)
        return first, _ask(http, url, turn + [{"role": "assistant", "content": str(2 * i)},
                                              {"role": "user", "content": "And times two?"}])

    # NOTE: 2 at a time: no replica gets over the router's imbalance (4) deeper than the other, where
    # a first turn would spill away from its home
    with httpx.Client(timeout=WAIT_S) as http, ThreadPoolExecutor(2) as pool:
        turns = list(pool.map(lambda i: conversation(http, i), range(CONVERSATIONS)))
        same = sum(a == b for a, b in turns)
        print(f"{same} of {CONVERSATIONS} second turns on their first turn's replica; first turns on "
              f"{len({a for a, _ in turns})} replicas")
        assert same == CONVERSATIONS and len({a for a, _ in turns}) == 2
        # a session key keeps a session's requests together, whatever they say
        by_header = {_ask(http, url, [{"role": "user", "content": f"topic {i}"}], {"x-omnivox-session": "s-1"})
                     for i in range(3)}
        by_user = {_ask(http, url, [{"role": "user", "content": f"topic {i}"}], user="user-7") for i in range(3)}
        assert len(by_header) == 1 and len(by_user) == 1
