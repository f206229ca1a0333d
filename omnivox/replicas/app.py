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
    """What one engine replica reserves: a CPU and one GPU per CUDA device its stages use
    (--device, --placement), or with --tensor-parallel-size k a placement group: bundle 0 for the
    replica (its own devices, the Thinker's rank 0 among them), one bundle per other rank (their
    workers start in it, `omnivox.parallel`). Inside a replica CUDA devices are numbered from 0
    within what Ray gave it (CUDA_VISIBLE_DEVICES): `--placement` names cuda:0..k-1."""
    from omnivox.engine.placement import Placement

    used = {args.device, *Placement.parse(args.placement, args.device).devices.values()}
    gpus = len({d for d in used if str(d).startswith("cuda")})
    own = {"num_cpus": 1, "num_gpus": gpus}
    if args.tensor_parallel_size == 1:
        return {"ray_actor_options": own}
    rank = {"GPU": 1} if gpus else {"CPU": 1}
    return {"ray_actor_options": own, "placement_group_strategy": "PACK",
            "placement_group_bundles": [{"CPU": 1, **({"GPU": gpus} if gpus else {})}]
            + [rank] * (args.tensor_parallel_size - 1)}


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
    return ingress.bind(engine.bind(args, api_key), args, api_key)
