"""What each engine replica reserves from Ray (omnivox/replicas/app.py `resources`)."""
from __future__ import annotations

from omnivox.cli import build_parser
from omnivox.replicas.app import resources


def reserved(*argv: str) -> dict:
    return resources(build_parser().parse_args(["serve", "--replicas", "2", *argv]))


def test_a_cpu_replica_reserves_one_cpu():
    assert reserved() == {"ray_actor_options": {"num_cpus": 1, "num_gpus": 0}}


def test_a_gpu_replica_reserves_each_device_its_stages_use():
    assert reserved("--device", "cuda")["ray_actor_options"]["num_gpus"] == 1
    two = reserved("--device", "cuda:0", "--placement", "talker=cuda:1,vocoder=cuda:1")
    assert two == {"ray_actor_options": {"num_cpus": 1, "num_gpus": 2}}


def test_tensor_parallel_replicas_get_one_bundle_per_extra_rank():
    tp = reserved("--device", "cuda", "--tensor-parallel-size", "4")
    assert tp["placement_group_bundles"] == [{"CPU": 1, "GPU": 1}, {"GPU": 1}, {"GPU": 1}, {"GPU": 1}]
    assert tp["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}
    cpu = reserved("--tensor-parallel-size", "2")
    assert cpu["placement_group_bundles"] == [{"CPU": 1}, {"CPU": 1}]
