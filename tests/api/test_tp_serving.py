"""`omnivox serve --tensor-parallel-size 2` on the demo: it serves, and nothing of it (the server,
its rank, their rendezvous store and gloo sockets) listens beyond loopback; a killed rank turns
/health and every request into 503 `engine_failed` (the server does not hang); Ctrl-C stops the
server with every rank gone. Each wait is bounded; each server is stopped by its test."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from api_helpers import running_server, wait_for
from process_tree import LOOPBACK, listeners

CHAT = {"model": "omnivox-demo-qwen3-omni", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _workers(pid: int) -> list[int]:
    """The tensor-parallel workers the server process started."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"tp_worker" in cmd:
            out.append(int(stat.parent.name))
    return out


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_it_listens_on_loopback_only_and_ctrl_c_stops_it_and_its_ranks(demo_cache):
    cache, _ = demo_cache
    with running_server(cache, "--tensor-parallel-size", "2") as (url, proc, log):
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 200, r.text
        assert "tensor-parallel over 2" in log.read_text()
        workers = _workers(proc.pid)
        assert len(workers) == 1
        found = listeners(proc.pid)
        print("listening:", *found, sep="\n  ")
        assert {x.pid for x in found} == {proc.pid, *workers}  # the store, gloo's pairs, HTTP
        assert all(x.ip in LOOPBACK for x in found), found
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    wait_for(lambda: all(_gone(w) for w in workers), 10, "every rank gone with the server")


def test_a_killed_rank_turns_the_server_to_503(demo_cache):
    cache, _ = demo_cache
    with running_server(cache, "--tensor-parallel-size", "2") as (url, proc, _log):
        workers = _workers(proc.pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 503, 10, "/health answers 503")
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed", r.text
        r = httpx.post(url + "/v1/audio/speech", json={"model": CHAT["model"], "input": "hi"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed", r.text
