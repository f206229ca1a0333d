import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))  # api_helpers


def pytest_configure(config):
    # Ray Serve 2.60's own pydantic models warn on import (PydanticDeprecatedSince20); not ours
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:ray.*")
