"""How a served model (`models/<family>/served.py`) holds its engine: built from the family's
stage graph on first use, stopped by `close` (a later use starts a new one)."""
from __future__ import annotations

from omnivox.engine.config import EngineConfig
from omnivox.engine.engine import Engine
from omnivox.engine.graph import StageGraph


class EngineOwner:
    engine_config: EngineConfig
    _engine: Engine | None = None

    def build_graph(self) -> StageGraph:
        """The family's stage graph over this model (its `served_graph`)."""
        raise NotImplementedError

    def engine_started(self, engine: Engine) -> None:
        """Called once a new engine exists (default: nothing)."""

    @property
    def engine(self) -> Engine:
        """The continuous-batching engine (started on first use)."""
        if self._engine is None:
            self._engine = Engine(self.build_graph(), self.engine_config)
            self.engine_started(self._engine)
        return self._engine

    def close(self) -> None:
        """Stop the engine (a later use starts a new one)."""
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
