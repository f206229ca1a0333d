"""One engine replica: omnivox's own server (model, engine, `create_app` with every limit of
`omnivox serve`, behind `Front`) loaded in-process, answering the ingress's calls through
`bridge`. Serve deploys it N times (`app.build`); the constructor returns once the model is
loaded and warmed up, which is when Serve starts routing to it (readiness)."""
from __future__ import annotations

import argparse
import os
from typing import AsyncIterator

import ray
from ray import serve

from omnivox.replicas.bridge import Socket, http_exchange


class EngineReplica:
    def __init__(self, args: argparse.Namespace, api_key: str | None):
        from omnivox.api.guards import HostPolicy
        from omnivox.api.hooks import load_hook_factory
        from omnivox.api.lifecycle import Front, Lifecycle
        from omnivox.serve import load_app

        self.replica = serve.get_replica_context().replica_id.unique_id
        hosts = HostPolicy.from_flags(args)
        hook_factory = load_hook_factory(args.text_hook) if args.text_hook else None
        self.lifecycle = Lifecycle()
        self.loaded = load_app(args, self.lifecycle, hosts, api_key, hook_factory)
        self.lifecycle.serve(self.loaded.app)
        self.front = Front(self.lifecycle, hosts)
        self.sockets: dict[str, Socket] = {}
        print(f"omnivox replica {self.replica} (pid {os.getpid()}): serving {self.loaded.name!r}; "
              f"KV cache: {self.loaded.model.kv_summary()}", flush=True)

    async def http(self, scope: dict, body: bytes, prefix_digest: str | None = None,
                   replica: str | None = None) -> AsyncIterator[dict | bytes]:
        """One HTTP request (`bridge.http_exchange`); the keywords are the router's."""
        async for item in http_exchange(self.front, scope, body, self.replica):
            yield item

    async def ws_open(self, session_id: str, scope: dict) -> AsyncIterator[dict]:
        """A realtime session's WebSocket: yields what the app sends until it closes."""
        socket = self.sockets[session_id] = Socket(self.front, scope, self.replica)
        try:
            async for msg in socket.run():
                yield msg
        finally:
            self.sockets.pop(session_id, None)

    async def ws_send(self, session_id: str, message: dict) -> bool:
        """A client message for an open session; False when the session is not here (it ended)."""
        socket = self.sockets.get(session_id)
        if socket is not None:
            socket.put(message)
        return socket is not None

    async def ws_close(self, session_id: str) -> None:
        """The client went away (the router drops the session's pin on this call)."""
        socket = self.sockets.get(session_id)
        if socket is not None:
            socket.put({"type": "websocket.disconnect", "code": 1000})

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine stopped is replaced."""
        if not self.loaded.model.engine.alive:
            raise RuntimeError(f"replica {self.replica}: the engine stopped")

    def record_routing_stats(self) -> dict:
        """GET /health/ready's figures, for the router's load measure."""
        report = self.lifecycle.report()
        return {k: report[k] for k in ("ready", "running", "waiting", "kv_free_ratio", "realtime_sessions")}

    def whoami(self, replica: str | None = None, prefix_digest: str | None = None) -> dict:
        """This replica's id, process, tensor-parallel rank actors and the Ray node of each of its
        placement group's bundles (bundle 0: the replica; the keywords are the router's: `replica=ID`
        asks for one)."""
        tp = self.loaded.model.tp
        workers = list(getattr(tp.workers, "names", [])) if tp is not None else []
        group = ray.util.get_current_placement_group()
        nodes = (list(dict(sorted(ray.util.placement_group_table(group)["bundles_to_node_id"].items())).values())
                 if group is not None else [ray.get_runtime_context().get_node_id()])
        return {"replica": self.replica, "pid": os.getpid(), "workers": workers, "nodes": nodes}

    def __del__(self) -> None:  # Serve's shutdown of a replica (after its graceful drain)
        loaded = getattr(self, "loaded", None)
        if loaded is not None:
            loaded.app.state.close()
