"""What the hub gives each realtime session: the limits the server was started with and the parts
sessions share. A session knows its hub only through this (`SessionHost`), so imports run one
way: hub -> session kinds -> host.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from omnivox.api.admission import WorkPool
from omnivox.api.output_limits import OutputLimits
from omnivox.api.realtime.audio_input import PCM_RATE
from omnivox.api.realtime.metrics import RealtimeMetrics
from omnivox.serving import ServedModel


@dataclass(frozen=True)
class RealtimeLimits:
    allowed_origins: tuple[str, ...] = ()  # web origins besides the server's own ("*": any)
    idle_timeout_s: float = 300.0  # a session with no client event for this long is closed
    max_buffer_s: float = 300.0  # the most audio one user turn (the input buffer) may hold
    max_append_bytes: int = 15 * 2**20  # base64 characters per input_audio_buffer.append (OpenAI's 15 MiB)
    audio_window_s: float = 1.0  # the AuT attention window of realtime input (sessions may change it)
    max_window_s: float = 8.0
    inbox_bytes: int = 4 * 2**20  # client messages read ahead of the session's handling (~60 s of appended audio)
    max_sessions: int | None = None  # sessions at once (None: the engine's max_running)
    send_timeout_s: float = 10.0  # a send waiting this long on a full socket (a client not reading) closes it
    send_buffer_bytes: int = 2**20  # what a session's socket may hold unsent before its sends wait
    turn_idle_s: float = 30.0  # an open turn with no audio this long gives back its KV pages
    turn_kv_share: float = 0.5  # the most of the Thinker's KV pages open turns hold together
    # a full-duplex session's most seconds of input audio, /api/chat and /v1/realtime alike
    # (serve --duplex-max-session-s; None: the model's own maximum)
    duplex_max_session_s: float | None = None

    @property
    def max_turn_samples(self) -> int:
        return int(self.max_buffer_s * PCM_RATE)


@dataclass(frozen=True)
class SessionHost:
    """The hub as a session sees it (one per hub, shared by its sessions; loop-thread only)."""

    model: ServedModel
    served_name: str  # the model's name in the API (`?model=`, session.model)
    pool: WorkPool  # the realtime workers (`--realtime-workers`); a session holds one job at a time
    limits: RealtimeLimits
    output: OutputLimits  # what one response may generate (serve --max-output-tokens, --max-audio-seconds)
    metrics: RealtimeMetrics
    audio_window: Callable[[float], Any]  # the audio encoder's window arithmetic for an attention window (seconds)
    vad_model: Any  # the turn detector's weights (None for a model that does not listen)
    turn_room: Callable[[str], int]  # KV pages session id's open prompt may hold (the turns' share less the others')
