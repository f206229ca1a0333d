import sys
from pathlib import Path

import pytest

# api_helpers, and this folder's helpers (a package, so that `cluster` is package-scoped: pytest
# scopes a "package" fixture of a folder without __init__.py to the whole session)
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "api"), str(Path(__file__).resolve().parent)]


def pytest_configure(config):
    # Ray Serve 2.60's own pydantic models warn on import (PydanticDeprecatedSince20); not ours
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:ray.*")


@pytest.fixture(scope="package")
def cluster():
    """(base url, engine handle): shared_cluster.py's application, for test_replicas.py and
    test_replicas_safety.py. NOTE: package-scoped, it lives from the first of them to the end of
    this folder: the modules that start Ray instances of their own (test_drain.py,
    test_replica_failure.py) sort before them and must stay so (one Ray per process at a time)."""
    from shared_cluster import serving

    with serving() as running:
        yield running
