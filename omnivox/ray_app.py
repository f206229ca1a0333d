"""`serve run omnivox.ray_app:build_app model=... replicas=2 ...`: the application of
`omnivox serve --replicas N` for Ray's own CLI (a Serve config file, KubeRay). Each key=value is the
serve flag --key value (underscores or dashes; `flag=true` for a switch), parsed by omnivox's own
parser, so values are checked as `omnivox serve` checks them. The address Serve binds is Serve's
own (http_options); `host=` and `allowed_hosts=` still say which Host headers the ingress and the
replicas answer (as for `omnivox serve`: 127.0.0.1 answers loopback names only, 0.0.0.0 any
address of the machine)."""
from __future__ import annotations


def build_app(args: dict):
    from omnivox.replicas.launch import check_replica_args, parse_app_args
    from omnivox.replicas.app import build

    ns = parse_app_args(args)
    return build(ns, check_replica_args(ns))
