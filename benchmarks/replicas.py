"""`omnivox serve --replicas`: throughput of 1 and 2 engine replicas behind the Ray ingress beside
one plain `omnivox serve`, under one closed loop, and what the router adds to a call.

Closed loop: `--concurrency` clients, each sending its next POST /v1/audio/speech (pcm, a
numbered sentence, voices ethan/chelsie/aiden in turn: three prefix homes) as soon as the last
answered, for `--seconds`; printed: requests/s, audio-s/s (seconds of speech made per wall
second) and the request latency p50/p99. The plain server runs in a child process; the replicas
on a local Ray instance (CPU count of this machine, no dashboard, 100 MiB object store) started
here. Router: `--calls` handle calls to a replica with the router's keywords (a prefix digest, a
pinned session) beside a plain Ray actor call (the RPC alone) and a call of the same replica
method without keywords; p50/p99 in ms.

    python benchmarks/replicas.py [--seconds 20] [--concurrency 4] [--calls 300] [--model PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VOICES = ("ethan", "chelsie", "aiden")
RATE = 24000


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


async def closed_loop(url: str, model: str, concurrency: int, seconds: float) -> dict:
    stop, lat, audio = time.monotonic() + seconds, [], [0.0]

    async def client(k: int) -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            n = 0
            while time.monotonic() < stop:
                body = {"model": model, "input": f"Sentence number {k}-{n} is spoken here.", "voice": VOICES[n % 3],
                        "response_format": "pcm"}
                t = time.monotonic()
                r = await http.post(url + "/v1/audio/speech", json=body)
                r.raise_for_status()
                lat.append(time.monotonic() - t)
                audio[0] += len(r.content) / 2 / RATE
                n += 1

    t0 = time.monotonic()
    await asyncio.gather(*(client(k) for k in range(concurrency)))
    wall = time.monotonic() - t0
    return {"req/s": len(lat) / wall, "audio-s/s": audio[0] / wall, "p50 s": pct(lat, 50), "p99 s": pct(lat, 99)}


def wait_ready(url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health/ready", timeout=3).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain_server(args, served: str) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "omnivox.cli", "serve", "--port", str(port), *(["--model", args.model] if args.model else [])]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(f"http://127.0.0.1:{port}")
            return asyncio.run(closed_loop(f"http://127.0.0.1:{port}", served, args.concurrency, args.seconds))
        finally:
            proc.terminate()
            proc.wait(60)


def calls(fn, n: int) -> tuple[float, float]:
    ms = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t) * 1000)
    return pct(ms, 50), pct(ms, 99)


def router_costs(handle, n: int) -> dict:
    import ray

    @ray.remote(num_cpus=0)
    class Plain:
        def whoami(self) -> dict:
            return {}

    plain = Plain.remote()
    ray.get(plain.whoami.remote())
    pinned = handle.options(session_id="bench-session")
    return {
        "plain Ray actor call": calls(lambda: ray.get(plain.whoami.remote()), n),
        "handle, no routing key": calls(lambda: handle.whoami.remote().result(), n),
        "handle, prefix digest": calls(lambda: handle.whoami.remote(prefix_digest="ab" * 32).result(), n),
        "handle, pinned session": calls(lambda: pinned.whoami.remote().result(), n),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--model")
    args = p.parse_args()
    from omnivox.replicas.ray_cluster import start_own

    served = "omnivox-demo-qwen3-omni"
    rows = {"omnivox serve (no Ray)": plain_server(args, served)}
    # as `omnivox serve --replicas` starts its own: token authentication on, loopback
    start_own(object_store_memory=100 * 2**20, logging_level="ERROR", log_to_driver=False)
    import ray
    from ray import serve

    from omnivox.replicas.app import APP_NAME, build
    from omnivox.replicas.launch import check_replica_args, parse_app_args

    router = {}
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for n in (1, 2):
            values = {"replicas": 2, **({"model": args.model} if args.model else {})}
            ns = parse_app_args(values)
            key = check_replica_args(ns)
            ns.replicas = n  # 1: the ingress and router path with one engine, for the comparison
            t = time.monotonic()
            serve.run(build(ns, key), name=APP_NAME, route_prefix="/")
            start_s = time.monotonic() - t
            rows[f"--replicas {n} (ready in {start_s:.1f} s)"] = asyncio.run(
                closed_loop(f"http://127.0.0.1:{port}", served, args.concurrency, args.seconds))
            if n == 2:
                router = router_costs(serve.get_deployment_handle("Engine", app_name=APP_NAME), args.calls)
            serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"closed loop: {args.concurrency} clients, {args.seconds:g} s, POST /v1/audio/speech (pcm), {os.cpu_count()} CPUs")
    print(f"{'':40} {'req/s':>7} {'audio-s/s':>10} {'p50 s':>7} {'p99 s':>7}")
    for name, r in rows.items():
        print(f"{name:40} {r['req/s']:7.2f} {r['audio-s/s']:10.2f} {r['p50 s']:7.3f} {r['p99 s']:7.3f}")
    print(f"\n{args.calls} calls each{'':24} {'p50 ms':>7} {'p99 ms':>7}")
    for name, (p50, p99) in router.items():
        print(f"{name:40} {p50:7.2f} {p99:7.2f}")


if __name__ == "__main__":
    main()
