"""`omnivox serve --replicas N`: checks the flags, starts (or joins) Ray (`ray_cluster.py`: its own
instance with token authentication on), runs the Serve application (`app.build`) on
--host:--port, says what listens where (`listeners.py`), waits for a signal, drains, stops.

Drain, as `omnivox serve` drains (`_drain`): the first SIGTERM or SIGINT puts the ingress in the
draining state (new requests 503 `draining`, new sessions 1013, readiness 503); running requests,
realtime responses and /api/chat sessions go on within --drain-timeout; then open sessions close
with 1012, the
application is deleted (each replica's graceful shutdown), Serve and Ray stop where this process
started them (a cluster joined with --ray-address keeps running, with its other Serve
applications), and the process exits 0. A second signal exits at once."""
from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import threading
import time

from omnivox.errors import OmnivoxError

# serve flags Ray's HTTP proxy cannot honour: refused with --replicas unless left at the default
UNSUPPORTED = {"header_timeout": "Ray's proxy has no header-read timeout"}
PROXY_TIMEOUT_S = 300.0  # for Serve to bring up an HTTP proxy that answers (start_serve)


def parse_app_args(values: dict) -> argparse.Namespace:
    """`serve run omnivox.ray_app:build_app key=value ...` -> the serve flags' namespace."""
    from omnivox.serve_args import add_serve_args

    argv = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if str(value).lower() == "true":
            argv.append(flag)
        elif str(value).lower() != "false":
            argv += [flag, str(value)]
    parser = argparse.ArgumentParser(prog="serve run omnivox.ray_app:build_app")
    add_serve_args(parser)
    ns = parser.parse_args(argv)
    if ns.replicas is None:
        raise OmnivoxError("pass replicas=N (N >= 2)")
    return ns


def check_replica_args(args: argparse.Namespace) -> str | None:
    """Checks what the replicas would find wrong only after loading; returns the API key."""
    from omnivox.api.hooks import load_hook_factory
    from omnivox.serve import check_args, resolve_api_key
    from omnivox.serve_args import add_serve_args

    if args.replicas < 2:
        raise OmnivoxError("--replicas must be 2 or more (one engine: omit --replicas)")
    if args.ray_insecure and args.ray_address:
        raise OmnivoxError("--ray-insecure applies to the Ray instance omnivox starts; a cluster joined with "
                           "--ray-address keeps its own settings")
    defaults = argparse.ArgumentParser()
    add_serve_args(defaults)
    for name, why in UNSUPPORTED.items():
        if getattr(args, name) != defaults.get_default(name):
            raise OmnivoxError(f"--{name.replace('_', '-')} cannot be used with --replicas: {why}")
    check_args(args)  # a bad --model fails before Ray starts
    api_key = resolve_api_key(args)
    if args.text_hook:
        load_hook_factory(args.text_hook)
    return api_key


def serve_replicas(args: argparse.Namespace) -> int:
    api_key = check_replica_args(args)
    if importlib.util.find_spec("ray") is None:
        raise OmnivoxError("--replicas runs on Ray Serve: pip install 'omnivox[ray]'")
    from omnivox.replicas import ray_cluster  # NOTE: imports ray only once it has set Ray's environment
    from omnivox.replicas.listeners import describe, listening

    started = time.monotonic()
    own_ray, own_serve, deployed = not args.ray_address, False, False
    options = {"logging_level": "WARNING", "log_to_driver": args.log_level in ("debug", "info")}
    # its own: a new instance (address "local"), never a cluster `ray start` left running on this machine
    access = ray_cluster.start_own(args.ray_insecure, **options) if own_ray else \
        ray_cluster.join(args.ray_address, include_dashboard=False, **options)
    from ray import serve

    from omnivox.replicas.app import APP_NAME, build
    try:
        before = serve.status()  # joining a cluster: Serve may run there already, with other apps
        if APP_NAME in before.applications:
            raise OmnivoxError(f"an application named {APP_NAME!r} already runs on the Ray cluster at "
                               f"{args.ray_address}: one omnivox per cluster")
        own_serve = not before.proxies
        start_serve({"host": args.host, "port": args.port or _free_port(args.host),
                     "keep_alive_timeout_s": args.keep_alive_timeout})
        host, port = _proxy_address()
        if not own_serve and args.port and args.port != port:
            print(f"omnivox serve: Serve already runs on this cluster; its proxy keeps port {port} "
                  f"(--port {args.port} is not applied)", file=sys.stderr, flush=True)
        stop = _signals()
        print(f"omnivox serve: starting {args.replicas} engine replicas on Ray "
              f"({'local' if own_ray else args.ray_address})", flush=True)
        deployed = True
        serve.run(build(args, api_key), name=APP_NAME, route_prefix="/", blocking=False)
        url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        print(f"serving on {url} with {args.replicas} replicas after {time.monotonic() - started:.1f} s "
              f"(OpenAI API: {url}/v1, realtime: {url.replace('http', 'ws', 1)}/v1/realtime)", flush=True)
        whose = "this process and its Ray instance" if own_ray else "this process"
        print(f"omnivox serve: {access.describe()}; listening ({whose}) {describe(listening())}", flush=True)
        stop.wait()
        _drain(serve.get_app_handle(APP_NAME), args.drain_timeout)
    finally:
        _leave(own_serve, deployed, own_ray)
    return 0


def start_serve(http_options: dict) -> None:
    """`serve.start`, surviving a proxy that Serve replaces while it starts. NOTE: Serve's controller
    kills an HTTP proxy that fails 3 ready checks in a row (each RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S:
    5 s by default, 30 s on omnivox's own instance, `ray_cluster.start_own`) and starts another: on a
    busy machine the first proxy can die so, and `serve.start`, which waits on that proxy's ready call,
    raises ActorDiedError although the controller runs and brings up a new proxy. Then this connects
    to that controller and waits, for at most PROXY_TIMEOUT_S, until every proxy is healthy."""
    from ray import serve
    from ray.exceptions import RayActorError
    from ray.serve.schema import ProxyStatus

    try:
        serve.start(http_options=http_options)
        return
    except RayActorError as e:
        print(f"omnivox serve: Serve replaced its HTTP proxy while starting ({str(e).splitlines()[-1][:200]}); "
              "waiting for the new one", file=sys.stderr, flush=True)
    serve.start(http_options=http_options)  # the controller that runs: nothing new is started
    deadline = time.monotonic() + PROXY_TIMEOUT_S
    while not (proxies := serve.status().proxies) or any(s != ProxyStatus.HEALTHY for s in proxies.values()):
        if time.monotonic() > deadline:
            raise OmnivoxError(f"Serve's HTTP proxy did not start within {PROXY_TIMEOUT_S:g} s: {proxies}")
        time.sleep(0.5)


def _proxy_address() -> tuple[str, int]:
    """Where Serve's HTTP proxy listens (a Serve instance already running keeps its own)."""
    from ray.serve.context import _get_global_client  # NOTE: private; ray is pinned exactly

    config = _get_global_client().http_config
    return config.host, config.port


def _leave(own_serve: bool, deployed: bool, own_ray: bool) -> None:
    """Deletes this application (each replica's graceful shutdown); stops Serve and Ray only where
    this process started them: a cluster joined keeps running, with its other applications."""
    from ray import serve

    from omnivox.replicas.app import APP_NAME

    try:
        if own_serve:
            serve.shutdown()
        elif deployed:
            serve.delete(APP_NAME)
    finally:
        if own_ray:
            import ray
            ray.shutdown()


def _drain(ingress, timeout_s: float) -> None:
    """As `omnivox serve` drains: the ingress refuses new work (503 `draining`, 1013); running requests,
    realtime responses and /api/chat sessions go on, for at most `timeout_s`; then open sessions
    close with 1012."""
    ingress.drain.remote().result()
    deadline = time.monotonic() + timeout_s
    left = ingress.working.remote().result()
    print(f"omnivox serve: draining, {left} request(s) running; exiting when they finish or in {timeout_s:g} s "
          "(--drain-timeout; a second signal exits now)", file=sys.stderr, flush=True)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = ingress.working.remote().result()
    if left:
        print(f"omnivox serve: drain timeout: {left} request(s) still running are cut", file=sys.stderr, flush=True)
    ingress.close_sessions.remote().result()


def _signals() -> threading.Event:
    """Set by the first SIGTERM or SIGINT; a second one exits at once."""
    stop = threading.Event()

    def handle(sig, frame):
        if stop.is_set():
            os.write(2, b"omnivox serve: a second signal: exiting now, cutting what still runs\n")
            os._exit(128 + sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handle)
    return stop


def _free_port(host: str) -> int:
    import socket
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
