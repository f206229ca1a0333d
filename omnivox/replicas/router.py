"""Ray Serve's side of the routing policy (`routing.choose`): a `RequestRouter` (Serve 2.60's
alpha API, hence the exact ray pin) for the engine deployment. NOTE: not `FIFOMixin`, which hands
a chosen replica to the oldest waiting call instead of the call it was chosen for."""
from __future__ import annotations

from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from omnivox.replicas.routing import Call, choose

CLOSE_METHOD = "ws_close"  # the last call of a realtime session: its pin goes


class ReplicaRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 4, max_sessions: int = 100_000, **kwargs) -> None:
        self.imbalance, self.max_sessions = imbalance, max_sessions
        self.pins: OrderedDict[str, str] = OrderedDict()  # session id -> replica unique id

    def load(self, replica: RunningReplica) -> int:
        """Calls queued or running on `replica` as Serve counts them, plus the requests its engine
        has waiting (`record_routing_stats`: /health/ready's figures, refreshed every few seconds)."""
        queued = self.replica_queue_len_cache.get(replica.replica_id) or 0
        return queued + int((replica.routing_stats or {}).get("waiting", 0))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas] if candidate_replicas else []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        kw = pending_request.kwargs
        call = Call(session_id=pending_request.metadata.session_id or None, replica=kw.get("replica"),
                    prefix_digest=kw.get("prefix_digest"))
        unready = frozenset(rid for rid, r in by_id.items() if not (r.routing_stats or {}).get("ready", True))
        ranks = choose(call, {rid: self.load(r) for rid, r in by_id.items()}, self.pins, self.imbalance, unready)
        if len(ranks) == 1 and len(ranks[0]) == 1:
            pending_request.routing_context.should_backoff = True  # strict: wait for that replica's room
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        session = pending_request.metadata.session_id
        if not session:
            return
        if pending_request.metadata.call_method == CLOSE_METHOD:
            self.pins.pop(session, None)
            return
        self.pins[session] = replica_id.unique_id
        self.pins.move_to_end(session)
        while len(self.pins) > self.max_sessions:
            self.pins.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for session in [s for s, r in self.pins.items() if r == replica_id.unique_id]:
            del self.pins[session]
