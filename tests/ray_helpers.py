"""Ray for the tests, started as `omnivox serve --replicas` starts its own (`ray_cluster.start_own`:
token authentication on, everything on loopback), and a client without its token."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from omnivox.replicas.ray_cluster import AUTH_MODE, TOKEN, TOKEN_PATH, secure_environment, start_own

TESTS = Path(__file__).resolve().parent
AUTH_VARS = (AUTH_MODE, TOKEN, TOKEN_PATH)


@contextlib.contextmanager
def _auth_variables_restored():
    """The Ray authentication variables as they were before the block (servers the suite starts
    later get none of them)."""
    saved = {k: os.environ.get(k) for k in AUTH_VARS}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def ray_environment():
    """`secure_environment()` for a block: the Ray this process starts runs with a fresh token."""
    with _auth_variables_restored():
        yield secure_environment()


@contextlib.contextmanager
def own_ray(**init_options):
    """A Ray instance of this process's own, as `omnivox serve --replicas` starts it; shut down after."""
    import ray

    with _auth_variables_restored():
        try:
            yield start_own(**init_options)
        finally:
            ray.shutdown()


def no_token_env(home: Path) -> dict[str, str]:
    """This process's environment with no Ray token in it, nor in its home (`home`, empty)."""
    env = {k: v for k, v in os.environ.items() if k not in AUTH_VARS and k != "RAY_ADDRESS"}
    return dict(env, HOME=str(home))


def call_without_token(targets: dict, home: Path, token: str | None = None) -> dict:
    """What Ray's servers answer a process that has no token (`no_token_client.py`), or `token`."""
    args = [sys.executable, str(TESTS / "replicas" / "no_token_client.py"), json.dumps(targets)]
    out = subprocess.run(args + ([token] if token else []), env=no_token_env(home), capture_output=True, text=True,
                         timeout=120, cwd=TESTS.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def proxy_ids() -> dict[str, str]:
    """Name -> actor id of every live Serve HTTP proxy (one per node; a replacement keeps the name)."""
    import ray

    found = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith("SERVE_PROXY_ACTOR"):
            found[a["name"]] = ray.get_actor(a["name"], namespace=a["namespace"])._actor_id.hex()
    return found


@contextlib.contextmanager
def first_proxy_killed(timeout_s: float = 60.0):
    """Kills Serve's first HTTP proxy as soon as it exists, long before it can answer its ready call,
    as Serve's controller kills one that starts slowly on a busy machine; yields the list of the
    actor ids killed (one, once the block ends)."""
    import ray

    killed = []

    def kill():
        deadline = time.monotonic() + timeout_s
        while not killed and time.monotonic() < deadline:
            for name, actor in proxy_ids().items():
                ray.kill(ray.get_actor(name, namespace="serve"))
                killed.append(actor)
            time.sleep(0.02)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    try:
        yield killed
    finally:
        killer.join(timeout_s)
