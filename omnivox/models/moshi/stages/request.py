"""A duplex session as the engine sees it: one request whose prompt stream stays open (the user's
frames), the user's codes as the encoder computed them, how it samples, and when each of its
output frames is due (its input frame's arrival + one frame)."""
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
    finish_reason: str = "stop"  # "length" once the session reaches its max_frames
    params: MoshiSamplingParams = GREEDY
    seed: int = 0
    max_frames: int = 1  # the most input frames the session takes
    user: UserCodes = field(default_factory=UserCodes)
    # input frame i's arrival on the engine clock (`SessionInput` stamps it as it sends the frame;
    # the zero-padded last one at close). Appended by the caller's thread, read by the engine's
    arrivals: list[float] = field(default_factory=list)
    delay: int = 0  # the LM's max_delay: output frame j is made in the step that consumes input frame j + delay
    frame_s: float = 0.08  # seconds of audio per frame

    @property
    def live(self) -> bool:
        """A session its user hears as it is made (`playing`); an offline one (`Duplex`) is batch work."""
        return self.playing

    def frame_due(self, frame: int) -> float | None:
        """Output frame `frame` is due one frame after input frame `frame + delay` arrived (None:
        that frame has not arrived)."""
        i = frame + self.delay
        return self.arrivals[i] + self.frame_s if i < len(self.arrivals) else None
