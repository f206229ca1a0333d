"""Engine replicas that span Ray nodes (`--tensor-parallel-size 2`: rank 1 is a Ray actor in the
replica's second placement-group bundle, on another node) and a replica whose engine stops (its
rank actor killed): it says so (readiness 503, requests 503 `engine_failed`), the router sends new
work to the other replica, and Serve's health check replaces it, rank actor and all.

One local multi-node Ray for the module (`ray.cluster_utils.Cluster`: 4 raylets of 1 CPU each on
this machine, so each replica's 2 bundles land on 2 nodes; no dashboard, 100 MiB object store per
node, token authentication on), shut down by the fixture; every wait is bounded. Multi-node here
means separate raylets on one host (gloo over its address, 127.0.0.1 here), not separate machines."""
from __future__ import annotations

import json

import httpx
import pytest

from api_helpers import free_port, wait_for
from omnivox.replicas.digest import request_digest
from omnivox.replicas.routing import home_replica

MODEL = "omnivox-demo-qwen3-omni"
REPLICA = "x-omnivox-replica"
WAIT_S = 90.0
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "modalities": ["text"],
        "temperature": 0}


@pytest.fixture(scope="module")
def tp_cluster():
    """(base url, engine handle): 2 engine replicas of the demo, each tensor-parallel over 2 ranks
    on 2 nodes."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from omnivox.replicas.app import APP_NAME, build
    from omnivox.replicas.launch import check_replica_args, parse_app_args, start_serve
    from ray_helpers import ray_environment

    args = parse_app_args({"replicas": 2, "tensor_parallel_size": 2, "drain_timeout": 5, "max_running": 4})
    port = free_port()
    store = 100 * 2**20
    with ray_environment():  # token authentication on, as `omnivox serve --replicas` runs its Ray
        cluster = Cluster(initialize_head=True, connect=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False, "object_store_memory": store})
        try:
            for _ in range(3):
                cluster.add_node(num_cpus=1, object_store_memory=store)
            start_serve({"host": "127.0.0.1", "port": port})  # as omnivox starts it
            serve.run(build(args, check_replica_args(args)), name=APP_NAME, route_prefix="/")
            yield f"http://127.0.0.1:{port}", serve.get_deployment_handle("Engine", app_name=APP_NAME)
        finally:
            serve.shutdown()
            ray.shutdown()
            cluster.shutdown()


def replicas(engine) -> dict[str, dict]:
    """Replica id -> whoami, for the replicas the router currently reaches (a few calls each)."""
    seen = {}
    for _ in range(8):
        me = engine.whoami.remote().result(timeout_s=WAIT_S)
        seen[me["replica"]] = me
    return seen


def tp_actors() -> set[str]:
    import ray
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("omnivox-tp-")}


def chat(url: str, replica: str | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=CHAT, headers={REPLICA: replica} if replica else {},
                      timeout=WAIT_S)


def test_each_replica_spans_two_nodes_and_answers_as_one_process(tp_cluster, demo_omni):
    url, engine = tp_cluster
    wait_for(lambda: len(replicas(engine)) == 2, WAIT_S, "both replicas reachable")
    seen = replicas(engine)
    for me in seen.values():
        assert len(me["nodes"]) == 2 and me["nodes"][0] != me["nodes"][1], me  # rank 1 on another node
        assert len(me["workers"]) == 1 and me["workers"][0].endswith("-rank1") and me["workers"][0] in tp_actors()
    want = demo_omni.generate(CHAT["messages"], greedy=True, max_tokens=CHAT["max_tokens"], return_audio=False).text
    assert want
    for replica in seen:
        r = chat(url, replica)
        assert r.status_code == 200 and r.headers[REPLICA] == replica, r.text
        assert r.json()["choices"][0]["message"]["content"] == want  # greedy: the unsharded model's text


def test_a_replica_whose_engine_stops_is_avoided_then_replaced(tp_cluster):
    import ray
    url, engine = tp_cluster
    seen = replicas(engine)
    # the victim is CHAT's home replica: its requests would go there but for the victim's readiness
    victim = home_replica(request_digest("/v1/chat/completions", json.dumps(CHAT).encode()), list(seen))
    other = (set(seen) - {victim}).pop()
    ray.kill(ray.get_actor(seen[victim]["workers"][0]))  # its rank 1 dies: its engine stops
    # it says so, and refuses what is sent to it by name
    wait_for(lambda: httpx.get(url + "/health/ready", headers={REPLICA: victim}, timeout=WAIT_S).status_code == 503,
             WAIT_S, "the victim's readiness to say 503")
    r = chat(url, victim)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed", r.text
    # new work goes to a replica that can take it (the router reads each replica's readiness figures)
    wait_for(lambda: all(r.status_code == 200 for r in [chat(url) for _ in range(4)]), WAIT_S,
             "requests without a replica named to be served")
    assert all(chat(url).headers[REPLICA] != victim for _ in range(4))
    assert httpx.get(url + "/health/ready", timeout=WAIT_S).status_code == 200
    # Serve's health check replaces the victim: a new replica with its own rank actor, the old one gone
    wait_for(lambda: victim not in (now := replicas(engine)) and len(now) == 2, WAIT_S, "a replacement replica")
    now = replicas(engine)
    assert other in now and seen[victim]["workers"][0] not in tp_actors()
    new = (set(now) - {other}).pop()
    assert now[new]["workers"] and set(now[new]["workers"]) <= tp_actors() and len(set(now[new]["nodes"])) == 2
    r = chat(url, new)
    assert r.status_code == 200 and r.headers[REPLICA] == new, r.text
