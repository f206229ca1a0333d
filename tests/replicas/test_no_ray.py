"""`omnivox serve` without --replicas never imports ray; --replicas' start-up checks run before Ray
starts (no Ray process here)."""
from __future__ import annotations

import os

import httpx
import pytest

from api_helpers import running_server
from omnivox.cli import build_parser
from omnivox.errors import OmnivoxError
from omnivox.replicas.launch import parse_app_args, prepare


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
])
def test_replicas_refuses_at_start_up_what_it_cannot_serve(argv, message):
    with pytest.raises(OmnivoxError, match=message):
        prepare(serve_args(*argv))


def test_serve_run_arguments_are_the_serve_flags():
    ns = parse_app_args({"replicas": 2, "max_running": "4", "drain-timeout": 5, "enforce_eager": "true"})
    assert (ns.replicas, ns.max_running, ns.drain_timeout, ns.enforce_eager) == (2, 4, 5.0, True)
    with pytest.raises(OmnivoxError, match="replicas=N"):
        parse_app_args({"max_running": 4})
