"""Which engine replica takes a call: the router's policy as one pure function (ints, strings and
dicts; no Ray), so it is unit tested without a cluster. `router.ReplicaRouter` feeds it Serve's
replicas and queue lengths and hands its ranks back to Serve.

The rule, first match wins:
  1. a realtime session (`session_id`) already pinned to a live replica: that replica only (its
     state lives there: a call never goes elsewhere, it waits). A new session: the least loaded.
  2. a call naming a replica (`replica`, from the `x-omnivox-replica` request header: an
     operator reading one replica's /metrics): that replica only, if it is live.
  3. a `prefix_digest` (chat: the conversation's head or session; speech: the voice, `digest.py`):
     its home replica only, a stable hash over the replicas sorted by id, so requests sharing a
     prefix meet its cached KV pages; unless the home is more than `imbalance` calls deeper than
     the least loaded replica, which then takes it (a hot prefix spills instead of queueing).
     NOTE: strict, as a session: with a second rank, a home that answers Serve's queue-length
     probe late (a busy CPU) would lose the call to another replica.
  4. otherwise the least loaded.
A replica that is not ready (`unready`: its engine stopped, until Serve's health check replaces
it) takes no new session and no call of rules 3-4 while another replica is ready; the homes of
the other digests stay where they were.
Each answer is a list of ranks, most preferred first; Serve tries a rank's replicas (the least
loaded one with room first) before the next rank. A strict answer has one rank."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Call:
    """What the router reads from one handle call."""
    session_id: str | None = None
    replica: str | None = None
    prefix_digest: str | None = None


def home_replica(digest: str, replicas: list[str]) -> str:
    """The replica a digest belongs to while the set of replicas is unchanged."""
    ordered = sorted(replicas)
    return ordered[int(digest[:16], 16) % len(ordered)]


def choose(call: Call, load: dict[str, int], pins: dict[str, str], imbalance: int,
           unready: frozenset[str] = frozenset()) -> list[list[str]]:
    """Ranks of replica ids for `call`. `load`: each live replica's queued + running calls;
    `pins`: session id -> replica of the sessions already placed; `unready`: live replicas whose
    engine stopped."""
    if not load:
        return []
    if call.session_id is not None and pins.get(call.session_id) in load:
        return [[pins[call.session_id]]]
    if call.replica is not None and call.replica in load:
        return [[call.replica]]
    replicas = sorted(r for r in load if r not in unready) or sorted(load)
    least = min(replicas, key=lambda r: (load[r], r))
    if call.session_id is not None:
        return [[least], replicas]
    if call.prefix_digest:
        home = home_replica(call.prefix_digest, list(load))
        first = home if home in replicas and load[home] - load[least] <= imbalance else least
        return [[first]]
    return [replicas]
