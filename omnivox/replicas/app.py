"""The Serve application of `omnivox serve --replicas N`: one ingress (no model) in front of N
engine replicas, each reserving its devices through Ray."""
from __future__ import annotations

import argparse

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from omnivox.replicas.engine import EngineReplica
from omnivox.replicas.ingress import Ingress
from omnivox.replicas.router import ReplicaRouter

APP_NAME = "omnivox"
IMBALANCE = 4  # calls a prefix's home replica may be deeper than the least loaded before it spills
STATS_PERIOD_S = 2.0  # record_routing_stats
HEALTH_PERIOD_S = 2.0  # check_health; 3 failures in a row replace a replica


def resources(args: argparse.Namespace) -> dict:
    """What one engine replica reserves: a CPU (and its GPUs on CUDA), or with
    --tensor-parallel-size k a placement group: bundle 0 for the replica (and rank 0), one bundle
    per other rank (their workers start in it, `omnivox.parallel`). Devices inside a replica are
    numbered from 0 within what Ray gave it (CUDA_VISIBLE_DEVICES)."""
    gpu = str(args.device).startswith("cuda")
    devices = {d for d in (args.placement or {}).values() if str(d).startswith("cuda")} if args.placement else set()
    per_replica = max(1, len(devices)) if gpu else 0
    tp = args.tensor_parallel_size
    if tp > 1:
        rank = {"GPU": 1} if gpu else {"CPU": 1}
        return {"ray_actor_options": {"num_cpus": 1, "num_gpus": 1 if gpu else 0},
                "placement_group_bundles": [{"CPU": 1, **({"GPU": 1} if gpu else {})}] + [rank] * (tp - 1),
                "placement_group_strategy": "PACK"}
    return {"ray_actor_options": {"num_cpus": 1, "num_gpus": per_replica}}


def build(args: argparse.Namespace, api_key: str | None) -> Application:
    sessions = args.max_realtime_sessions or args.max_running
    # Serve's cap on calls at one replica stays above what the replica refuses itself (503 busy,
    # 1013 sessions), so every refusal is omnivox's own; a session holds two calls at a time
    ongoing = args.max_running + args.max_queue + 2 * sessions + 16
    engine = serve.deployment(EngineReplica, name="Engine").options(
        num_replicas=args.replicas, max_ongoing_requests=ongoing, max_queued_requests=-1,
        graceful_shutdown_timeout_s=args.drain_timeout, graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=HEALTH_PERIOD_S, health_check_timeout_s=30,
        request_router_config=RequestRouterConfig(request_router_class=ReplicaRouter,
                                                  request_router_kwargs={"imbalance": IMBALANCE},
                                                  request_routing_stats_period_s=STATS_PERIOD_S),
        **resources(args))
    ingress = serve.deployment(Ingress, name="Ingress").options(
        num_replicas=1, max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=args.drain_timeout, graceful_shutdown_wait_loop_s=0.5)
    return ingress.bind(engine.bind(args, api_key), int(args.max_body_mb * 2**20))
