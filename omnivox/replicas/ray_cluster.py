"""The Ray that `omnivox serve --replicas` runs on: an instance of its own, safe by default, or a
cluster it joins with --ray-address, whose settings it keeps.

Its own instance (`start_own`, `ray.init(address="local")`):
- token authentication on, set explicitly whatever the environment says (a `RAY_AUTH_MODE=disabled`
  left in a shell is not inherited): Ray's gRPC servers (GCS, raylet, every worker) and its
  agents refuse a caller without the token. The token is RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH
  when you set one, else a fresh one for this instance, held only in the environment of its
  processes (never written to disk). `--ray-insecure` turns authentication off, with a warning.
- node address 127.0.0.1 (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`: Ray's single-machine mode, the
  only way to it; `ray.init(_node_ip_address="127.0.0.1")` is turned back into the LAN address):
  its gRPC servers, agents and Prometheus exporters (autoscaler, dashboard, metrics agent) listen
  on loopback only. Serve 2.60 binds each replica's inter-replica gRPC server to every interface
  itself (token-guarded); `listeners.py` says so at start-up. NOTE: Ray reads that variable once,
  when it is imported, so this module imports ray only after setting it.
- no dashboard.
- Serve's HTTP proxy gets 30 s, not 5 s, to answer each ready check (RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S
  unless set), so that a proxy slow to start on a busy machine is not killed and restarted in a loop.

A joined cluster (`join`): Ray's own settings (RAY_AUTH_MODE and the token as Ray reads them);
once joined, one call without a token to its GCS tells whether it answers anyone, and if it
does a warning says so (the README's "Ray, safe by default" says what a cluster opens and how to
protect it).
"""
from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass

AUTH_MODE, TOKEN, TOKEN_PATH = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": the node's address is 127.0.0.1
PROXY_READY = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"  # Serve's default 5 s; its own instance: 30 s
PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RayAccess:
    """Who may call the Ray this process runs on."""
    where: str  # "local" (its own instance) or the cluster's address
    authenticated: bool  # callers without the token are refused
    token: str  # where the token comes from ("" without authentication)

    def describe(self) -> str:
        if not self.authenticated:
            return f"Ray {self.where}: token authentication OFF"
        return f"Ray {self.where}: token authentication on (token: {self.token})"


def start_own(insecure: bool = False, **init_options) -> RayAccess:
    """A new Ray instance of this process's own (`init_options`: more of `ray.init`'s)."""
    access = secure_environment(insecure)
    # NOTE: Serve's controller kills an HTTP proxy that misses 3 ready checks in a row and starts
    # another: at 5 s each, a proxy starting on a busy machine is killed again and again, and each
    # new one takes one of Ray's few worker-start slots that the replicas wait for (2 replicas beside
    # a CPU hog took minutes). Its own instance's processes inherit this; a joined cluster keeps its own
    os.environ.setdefault(PROXY_READY, "30")
    import ray

    ray.init(address="local", include_dashboard=False, **init_options)
    node = ray.util.get_node_ip_address()
    if node != "127.0.0.1":
        print(f"omnivox serve: WARNING: Ray's node address is {node}, not 127.0.0.1 (ray was imported before "
              f"{SINGLE_MACHINE}=0 was set): its agents and exporters listen there", file=sys.stderr, flush=True)
    return access


def secure_environment(insecure: bool = False) -> RayAccess:
    """Sets this process's environment so that the Ray instance it starts next, and every process
    of it, runs on 127.0.0.1 with token authentication (off with `insecure`). NOTE: Ray caches its
    configuration and token per process: both are reloaded here, as Ray's own start-up does."""
    os.environ[SINGLE_MACHINE] = "0"
    from ray._raylet import AuthenticationTokenLoader, Config  # NOTE: private; ray is pinned exactly

    if insecure:
        os.environ[AUTH_MODE] = "disabled"
        print("omnivox serve: WARNING: --ray-insecure: Ray's token authentication is OFF: anyone who reaches "
              "this machine's Ray ports (listed below) can run code as this user", file=sys.stderr, flush=True)
        token = ""
    else:
        os.environ[AUTH_MODE] = "token"
        token = next((name for name in (TOKEN, TOKEN_PATH) if os.environ.get(name)), "")
        if not token:
            os.environ[TOKEN] = secrets.token_hex(32)
            token = "this instance's own, in its processes' environment only"
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    return RayAccess("local", not insecure, token)


def join(address: str, **init_options) -> RayAccess:
    """The Ray cluster at `address`, as Ray's settings in this environment reach it; warns when
    the cluster answers callers without a token."""
    import ray
    from ray.exceptions import AuthenticationError

    from omnivox.errors import OmnivoxError

    try:
        ray.init(address=address, **init_options)
    except AuthenticationError as e:
        raise OmnivoxError(f"the Ray cluster at {address} requires its token ({str(e).splitlines()[0][:200]}): set "
                           f"{AUTH_MODE}=token and the cluster's token in {TOKEN}, {TOKEN_PATH} or "
                           "~/.ray/auth_token") from None
    open_to_all = answers_anyone(ray.get_runtime_context().gcs_address)
    if open_to_all is not False:
        what = "answers callers without a token" if open_to_all else \
            "did not say whether it refuses callers without a token"
        print(f"omnivox serve: WARNING: the Ray cluster at {address} {what} ({AUTH_MODE}=token turns its "
              "authentication on): anyone who reaches its ports can run code on it. Turn on its token authentication "
              "and firewall its ports (README: Ray, safe by default)", file=sys.stderr, flush=True)
    return RayAccess(address, open_to_all is False, "the cluster's" if open_to_all is False else "")


def answers_anyone(gcs_address: str) -> bool | None:
    """Whether the GCS at `gcs_address` answers a call that carries no token (None: no answer)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(gcs_address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError as e:
            return False if e.code() == grpc.StatusCode.UNAUTHENTICATED else None
    return True
