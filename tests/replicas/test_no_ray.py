"""`omnivox serve` without --replicas never imports ray; --replicas' start-up checks run before Ray
starts, and the environment its own Ray instance gets (no Ray process here)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from api_helpers import running_server
from omnivox.cli import build_parser
from omnivox.errors import OmnivoxError
from omnivox.replicas.launch import check_replica_args, parse_app_args


def test_serve_without_replicas_never_imports_ray(tmp_path, monkeypatch):
    """A `ray` package first on the path that records being imported: a real server answers and
    the record stays absent."""
    fake = tmp_path / "path" / "ray"
    fake.mkdir(parents=True)
    marker = tmp_path / "ray-imported"
    (fake / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise ImportError('ray imported')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")]))
    with running_server(tmp_path / "cache") as (url, proc, log):
        assert httpx.get(url + "/v1/models").status_code == 200
        assert httpx.get(url + "/health/ready").status_code == 200
    assert not marker.exists()


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "1"], "--replicas must be 2 or more"),
    (["--replicas", "2", "--header-timeout", "3"], "--header-timeout cannot be used with --replicas"),
    (["--replicas", "2", "--model", "/nonexistent"], "does not exist"),
    (["--replicas", "2", "--first-chunk-frames", "40"], "--first-chunk-frames must be within 1-25"),
    (["--replicas", "2", "--ray-insecure", "--ray-address", "127.0.0.1:6379"],
     "--ray-insecure applies to the Ray instance omnivox starts"),
])
def test_replicas_refuses_at_start_up_what_it_cannot_serve(argv, message):
    with pytest.raises(OmnivoxError, match=message):
        check_replica_args(serve_args(*argv))


def test_serve_run_arguments_are_the_serve_flags():
    ns = parse_app_args({"replicas": 2, "max_running": "4", "drain-timeout": 5, "enforce_eager": "true"})
    assert (ns.replicas, ns.max_running, ns.drain_timeout, ns.enforce_eager) == (2, 4, 5.0, True)
    with pytest.raises(OmnivoxError, match="replicas=N"):
        parse_app_args({"max_running": 4})


def test_its_own_ray_gets_token_authentication_whatever_the_environment_says(tmp_path):
    """`ray_cluster.secure_environment` (what `start_own` runs before ray.init), in a process whose
    environment says RAY_AUTH_MODE=disabled: token mode and a fresh token of its own; with
    --ray-insecure: off, and a warning on stderr."""
    code = ("import json, os; from omnivox.replicas.ray_cluster import secure_environment as s; a = s(); "
            "token = os.environ['RAY_AUTH_TOKEN']; b = s(insecure=True); "
            "print(json.dumps([a.authenticated, len(token), b.authenticated, os.environ['RAY_AUTH_MODE']]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, RAY_AUTH_MODE="disabled", HOME=str(tmp_path)),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == [True, 64, False, "disabled"]
    assert "WARNING: --ray-insecure: Ray's token authentication is OFF" in out.stderr
    assert not (tmp_path / ".ray").exists()  # the token was never written to the home
