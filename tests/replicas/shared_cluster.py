"""The Serve application test_replicas.py and test_replicas_safety.py share (conftest.py's
`cluster`): Ray started as `omnivox serve --replicas` starts its own (token authentication on,
loopback; here 2 CPUs, 100 MiB object store) serving `omnivox.ray_app:build_app` with 2 replicas
on 127.0.0.1, with an API key, a 3 s body deadline, 48 MB bodies and 100 MB of them pending.
Serve starts as `omnivox serve --replicas` starts it (`start_serve`), its first HTTP proxy killed
while it starts (as Serve's controller kills one slow to start on a busy machine): the application
is served through the proxy Serve brings back."""
from __future__ import annotations

import contextlib

from api_helpers import free_port, wait_for
from ray_helpers import first_proxy_killed, own_ray, proxy_ids

MODEL = "omnivox-demo-qwen3-omni"
API_KEY = "test-key"
KEY = {"Authorization": f"Bearer {API_KEY}"}
BODY_TIMEOUT_S = 3
MAX_BODY_MB, MAX_PENDING_BODY_MB = 48, 100


@contextlib.contextmanager
def serving():
    """(base url, engine handle) of the application, until the block ends (Serve and Ray stopped)."""
    port = free_port()
    with own_ray(num_cpus=2, object_store_memory=100 * 2**20, logging_level="WARNING", log_to_driver=False):
        from ray import serve

        from omnivox.ray_app import build_app
        from omnivox.replicas.app import APP_NAME
        from omnivox.replicas.launch import start_serve

        try:
            with first_proxy_killed() as killed:
                start_serve({"host": "127.0.0.1", "port": port})  # raises nothing: it waits for the new proxy
            assert len(killed) == 1
            wait_for(lambda: (now := proxy_ids()) and killed[0] not in now.values(), 60, "a new proxy")
            # what `serve run omnivox.ray_app:build_app replicas=2 ...` deploys
            serve.run(build_app({"replicas": "2", "drain_timeout": "5", "max_running": "8", "api_key": API_KEY,
                                 "body_timeout": str(BODY_TIMEOUT_S), "max_body_mb": str(MAX_BODY_MB),
                                 "max_pending_body_mb": str(MAX_PENDING_BODY_MB)}),
                      name=APP_NAME, route_prefix="/")
            yield f"http://127.0.0.1:{port}", serve.get_deployment_handle("Engine", app_name=APP_NAME)
        finally:
            serve.shutdown()
