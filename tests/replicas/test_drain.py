"""`omnivox serve --replicas 2` as a process, beside another Ray cluster on this machine (`ray
start --head`, its token authentication off, Serve serving another application: the module's
`other_cluster`). Without --ray-address it starts a Ray instance of its own (not the cluster `ray
start` left there), with token authentication on whatever the environment says, and its start-up
line lists every socket its processes listen on (read back from the kernel here); SIGTERM drains
as `omnivox serve` does (new requests get 503 `draining`, readiness turns 503) while a running
stream finishes, then the process stops Serve and its Ray instance and exits 0. With
--ray-address it joins the cluster, warns that the cluster answers callers without a token,
serves beside the other application, and leaves the cluster, Serve and that application running."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from api_helpers import free_port, running_server, wait_for
from process_tree import LOOPBACK, listeners
from ray_helpers import AUTH_VARS, call_without_token

MODEL = "omnivox-demo-qwen3-omni"


def children(pid: int) -> set[int]:
    """Processes whose parent is `pid` (Ray's gcs_server, raylet, ... of a local instance)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


def alive(pids: set[int]) -> set[int]:
    return {p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in _state(p)}


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


LISTED = re.compile(r"(\[[0-9a-f:.]+\]|[0-9.]+):(\d+) ([^\s,;]+)")


def startup_listing(log: Path) -> str:
    """The start-up line saying what the server's processes listen on (once it is printed)."""
    wait_for(lambda: "listening (this process" in log.read_text(), 60, "the start-up line of listeners")
    return next(line for line in log.read_text().splitlines() if "listening (this process" in line)


def check_listing(line: str, pid: int) -> str:
    """The line names every socket the server's process tree listens on, where, and which process
    holds it (a Ray worker started after the line aside); returns the (address, port) of the GCS."""
    said = {(ip.strip("[]"), int(port)): name for ip, port, name in LISTED.findall(line)}
    found = listeners(pid)
    print("start-up line:", line, "listening now:", *found, sep="\n  ")
    now = {(x.ip, x.port): x for x in found}
    for (ip, port), name in said.items():
        assert (ip, port) in now or name == "ray::IDLE", f"{ip}:{port} {name} is said to listen, but does not"
        # a Ray worker's title names the method it runs while it runs one ("ray::Actor.method"), the
        # actor alone when idle: the line and the check may see either
        actor = name.split(".")[0] if name.startswith("ray::") else name
        assert (ip, port) not in now or actor in now[ip, port].process, (name, now[ip, port])
        # loopback, but for Serve's inter-replica gRPC servers (Serve binds them to [::] itself)
        assert ip in LOOPBACK or ip == "::ffff:127.0.0.1" or (ip == "::" and name.startswith("ray::ServeReplica"))
    newest = max(psutil.Process(now[k].pid).create_time() for k in said if k in now)
    unsaid = [x for k, x in now.items() if k not in said]
    assert all(psutil.Process(x.pid).create_time() > newest for x in unsaid), unsaid  # started after the line
    ip, port = next(k for k, name in said.items() if name == "gcs_server")
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def test_own_ray_says_what_listens_where_refuses_tokenless_callers_and_sigterm_drains(other_cluster, tmp_path,
                                                                                       monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # left in a shell: not inherited by its own instance
    for name in AUTH_VARS[1:] + ("RAY_ADDRESS",):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES", str(100 * 2**20))
    # the start-up bound is for liveness only: beside a CPU hog and other test runs on the 2 cores, two
    # replicas once took 138 s to load (Serve's log), the whole start ~190 s
    with running_server(tmp_path / "cache", "--replicas", "2", "--drain-timeout", "60", timeout=300) as (url, proc, log):
        ray_processes = children(proc.pid)
        assert ray_processes  # its own Ray instance (gcs_server, raylet, ...), not other_cluster's
        line = startup_listing(log)
        assert "Ray local: token authentication on (token: this instance's own" in line
        gcs = check_listing(line, proc.pid)
        home = tmp_path / "home"
        home.mkdir()
        assert call_without_token({"grpc": [[gcs, "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo"]]}, home) == \
            {"grpc": ["UNAUTHENTICATED"]}
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a long story"}], max_tokens=200, stream=True,
            modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"}, extra_body={"ignore_eos": True})
        finish, started = [], threading.Event()

        def read():
            for n, chunk in enumerate(stream):
                if n == 2:
                    started.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish.append(chunk.choices[0].finish_reason)
        reader = threading.Thread(target=read)
        reader.start()
        assert started.wait(90)
        proc.send_signal(signal.SIGTERM)

        def refused() -> bool:
            r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=30)
            return r.status_code == 503 and r.json()["error"]["code"] == "draining"
        wait_for(refused, 60, "new requests to get 503 draining")
        ready = httpx.get(url + "/health/ready", timeout=30)
        assert ready.status_code == 503 and ready.json()["state"] == "draining"
        reader.join(90)
        assert finish == ["length"]  # the stream ran to its end
        assert proc.wait(90) == 0, log.read_text()[-3000:]
        wait_for(lambda: not alive(ray_processes), 60, "the local Ray instance to stop")


class Other:
    """Another application on the cluster (not omnivox)."""

    async def __call__(self, request) -> str:
        return "other"


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def other_cluster():
    """(GCS port, Serve proxy port): a Ray cluster started by `ray start --head` (as an operator
    would), its Serve serving another application at /other; stopped at the end of the module."""
    gcs = free_port()
    env = {k: v for k, v in os.environ.items() if k not in AUTH_VARS}
    head = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--port", str(gcs), "--num-cpus", "3",
         "--include-dashboard", "false", "--disable-usage-stats", "--object-store-memory", str(100 * 2**20)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env=dict(env, RAY_AUTH_MODE="disabled"))  # an operator's cluster with its authentication off
    import ray
    from ray import cloudpickle, serve

    from omnivox.replicas.launch import start_serve
    try:
        wait_for(lambda: listening(gcs), 60, "the cluster's head to listen")
        ray.init(address=f"127.0.0.1:{gcs}", logging_level="WARNING", log_to_driver=False)
        port = free_port()
        start_serve({"host": "127.0.0.1", "port": port})  # as omnivox starts it
        cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Other, for the cluster's workers
        serve.run(serve.deployment(Other, ray_actor_options={"num_cpus": 0}).bind(), name="other",
                  route_prefix="/other")
        yield gcs, port
        assert head.poll() is None  # the cluster outlived every test
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            head.terminate()  # `ray start --block` stops the cluster's processes on SIGTERM
            head.wait(60)


def test_joining_a_cluster_leaves_it_and_its_other_application_running(other_cluster, tmp_path, monkeypatch):
    from ray import serve
    gcs, port = other_cluster
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for name in AUTH_VARS:
        monkeypatch.delenv(name, raising=False)
    with running_server(tmp_path / "cache", "--replicas", "2", "--ray-address", f"127.0.0.1:{gcs}", timeout=300,
                        port=port) as (url, proc, log):  # the port of the cluster's Serve proxy
        assert "answers callers without a token" in log.read_text()  # said before it served
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-omnivox-replica"], r.text
        assert httpx.get(url + "/other", timeout=30).text == "other"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, log.read_text()[-3000:]
    assert httpx.get(f"http://127.0.0.1:{port}/other", timeout=30).text == "other"
    assert set(serve.status().applications) == {"other"}
