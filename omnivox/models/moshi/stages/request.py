"""A duplex session as the engine sees it: one request whose prompt stream stays open (the user's
frames), the user's codes as the encoder computed them, and how it samples."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from omnivox.engine.prompt import HostRows
from omnivox.engine.request import Request
from omnivox.models.moshi.lm_sampling import GREEDY, MoshiSamplingParams


class UserCodes(HostRows):
    """The session's clip for the encoder stage (its identity and host record): the codes of each
    user frame, as ints, appended by the encoder stage once per step and read by the LM stage per
    position (no concatenation per read)."""

    def __init__(self) -> None:
        super().__init__()
        self.codes: list[list[int]] = []

    def append(self, rows: np.ndarray) -> None:
        if len(rows):
            self.codes.extend(rows.astype(np.int64).tolist())
            self.n += len(rows)

    def rows(self, start: int = 0, end: int | None = None) -> np.ndarray:
        return np.asarray(self.codes[start:end], dtype=np.float32)

    @property
    def nbytes(self) -> int:
        return 8 * sum(map(len, self.codes))


@dataclass(eq=False)
class DuplexRequest(Request):
    params: MoshiSamplingParams = GREEDY
    seed: int = 0
    max_frames: int = 1  # the most input frames the session takes
    user: UserCodes = field(default_factory=UserCodes)
