"""A realtime session's input audio: the pcm16 the client appends, turn detection on it, and each
user turn through the causal front end while it is being spoken, as host log-mel pieces for the
encoder stage. No model work and no tensor here: the AuT runs in the engine, as the first stage of
the listening request's route (`stages/encoder.py`); a turn only knows, by arithmetic
(`AudioWindow.rows`), how many rows each piece will make final.

Everything here runs in a worker thread (never on the event loop) and counts time in samples of
the session's 24 kHz input, never on a clock: appending faster than real time, in any piece
sizes, gives the same turns, pieces and rows.

A turn (`TurnAudio`) is StreamResampler(24 -> 16 kHz) -> CausalLogMel (its floor's peak carried
over from the previous turn) -> host pieces (`AudioPiece`) the encoder stage encodes with the
session's attention window. Because each step is chunk-invariant, a turn's features equal
`audio.input_stream.turn_features` of its samples, and its rows equal the one-shot encoder
(`AudioEncoder.forward(..., window_chunks=...)`) on them up to round-off. The rows, once encoded,
are kept on the host in the turn's `HostRows` (the first computation of each row), for the
conversation's later renders.

With server VAD (`TurnDetector`), a turn starts at speech_started's audio_ms (prefix padding
included), read back from the history this object keeps, and ends exactly at speech_stopped's
audio_ms. The turn is fed only audio the detector has already judged, so it never holds samples
past the end that the detector decides later.
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field

import numpy as np

from omnivox.audio.input_stream import CausalLogMel, StreamResampler
from omnivox.audio.vad import FRAME, VAD_RATE, TurnDetector
from omnivox.engine.prompt import AudioPiece, HostRows
from omnivox.errors import InputError

PCM_RATE = 24000  # the realtime protocol's pcm16 rate
MS = PCM_RATE // 1000  # samples per millisecond
VAD_FRAME_SAMPLES = FRAME * PCM_RATE // VAD_RATE  # one 32 ms detector frame in input samples (768)
PIECE_SAMPLES = PCM_RATE  # the most input audio one worker job takes: a second (~5-10 ms of work on the demo)


def decode_pcm16(data, param: str) -> np.ndarray:
    """A client's base64 pcm16 (little-endian int16) -> samples. # [n] int16"""
    if not isinstance(data, str):
        raise InputError(f"{param} must be a base64 string of pcm16 audio", param=param)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"{param} is not valid base64", param=param, code="invalid_base64") from None
    if len(raw) % 2:
        raise InputError(f"{param} must hold whole pcm16 samples (an even number of bytes), got {len(raw)}",
                         param=param, code="invalid_base64")
    return np.frombuffer(raw, dtype="<i2").astype(np.int16)


class TurnAudio:
    """One user turn, incrementally: pcm16 samples in, host log-mel pieces out (`pieces`), each
    with the number of rows it makes final (`AudioWindow.rows`: the encoder stage's count).
    `rows`: the turn's encoded rows on the host, filled by the encoder stage as it computes them.
    Once all are there the pieces are dropped (`settle`): a render then sends the rows."""

    def __init__(self, window, start: int, peak: float | None = None, rate: int = PCM_RATE):
        self.window = window  # the session's AudioWindow (ChatModel.audio_window)
        self.start = start  # absolute input sample where the turn begins
        self.fed = start  # absolute input sample up to which it has been fed
        self.resampler: StreamResampler | None = StreamResampler(rate, 16000)
        self.mel: CausalLogMel | None = CausalLogMel(peak=peak)
        self.peak = peak  # the log-mel floor's peak once the turn is done
        self.pieces: list[tuple[AudioPiece, int]] = []  # (piece, rows it makes final), in order
        self.rows = HostRows()
        self.frames = 0
        self.n_rows = 0
        self.done = False

    @property
    def samples(self) -> int:
        return self.fed - self.start

    def push(self, pcm: np.ndarray) -> None:
        if len(pcm):
            self.fed += len(pcm)
            self._piece(self.mel.push(self.resampler.push(pcm)))

    def finish(self) -> None:
        """End of the turn: the resampler's and the log-mel's tails, then the clip's end."""
        tail = np.concatenate([_host(self.mel.push(self.resampler.flush())), _host(self.mel.flush())], axis=1)
        self._piece(tail)
        self._piece(tail[:, :0], final=True)
        self.peak = self.mel.peak if self.mel.peak is not None else self.peak
        self.resampler = self.mel = None  # the front end's work is done
        self.done = True

    @property
    def complete(self) -> bool:
        """Every row of the finished turn is on the host (`rows`)."""
        return self.done and self.rows.n == self.n_rows

    def settle(self) -> None:
        """Drop the pieces once the rows they make are all on the host."""
        if self.complete:
            self.pieces = []

    @property
    def host_bytes(self) -> int:
        return self.rows.nbytes + sum(p.frames.nbytes for p, _ in list(self.pieces))

    def _piece(self, frames, final: bool = False) -> None:
        frames = _host(frames)
        if not frames.shape[1] and not final:
            return  # no frames: no work for the encoder
        self.frames += frames.shape[1]
        n = self.window.rows(self.frames, final) - self.n_rows
        self.pieces.append((AudioPiece(frames, self.rows, self.n_rows, final, self.window.window_chunks), n))
        self.n_rows += n


def _host(frames) -> np.ndarray:
    """The front end's frames as a host array of its own. # [n_mels, t] float32"""
    return np.array(frames.numpy() if hasattr(frames, "numpy") else frames, dtype=np.float32, copy=True)


@dataclass(frozen=True)
class VadSettings:
    """OpenAI's server_vad fields (the session's `turn_detection`)."""
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True


@dataclass(frozen=True)
class TurnOpened:
    """A manual turn began with this append (no turn detection)."""
    turn: TurnAudio = field(compare=False)


@dataclass(frozen=True)
class SpeechStarted:
    audio_ms: int  # where the turn begins (prefix padding included)
    turn: TurnAudio = field(compare=False)


@dataclass(frozen=True)
class SpeechStopped:
    audio_ms: int  # where the turn ends (the silence included)
    speech_end_sample: int  # the last voiced sample (audio_ms minus the silence), absolute
    turn: TurnAudio = field(compare=False)


class InputAudio:
    """The session's input: appended pcm (an absolute sample count), optional server VAD, and the
    open turn. Not thread-safe: one caller at a time (the session runs it in order)."""

    def __init__(self, window_factory, vad: VadSettings | None, max_turn_samples: int, vad_model=None):
        self.window_factory = window_factory  # () -> the session's AudioWindow
        self.max_turn_samples = max_turn_samples
        self.samples_in = 0
        self.peak: float | None = None  # the log-mel floor's peak, carried from turn to turn
        self.turn: TurnAudio | None = None
        self._vad_model = vad_model
        self._hist = np.zeros(0, np.int16)  # input from absolute sample _hist_start on
        self._hist_start = 0
        self.set_vad(vad)

    @property
    def history_bytes(self) -> int:
        return self._hist.nbytes

    # ---- configuration ------------------------------------------------------------------------
    def set_vad(self, vad: VadSettings | None) -> None:
        """(Re)start turn detection from the current sample (None: manual turns)."""
        self.vad = vad
        self.detector = None if vad is None else TurnDetector(
            vad.threshold, vad.prefix_padding_ms, vad.silence_duration_ms, PCM_RATE, model=self._vad_model)
        self._vad_origin = self.samples_in  # absolute sample of the detector's time 0

    # ---- input --------------------------------------------------------------------------------
    def append(self, pcm: np.ndarray) -> list[TurnOpened | SpeechStarted | SpeechStopped]:
        """Take the next pcm16 samples: run turn detection, feed the open turn. The events say
        which turns opened and closed, in order."""
        if self.turn is not None and self.samples_in + len(pcm) - self.turn.start > self.max_turn_samples:
            raise InputError(f"the input audio buffer holds more than {self.max_turn_samples // PCM_RATE} s: "
                             "commit or clear it first", code="input_audio_buffer_full")
        self._hist = np.concatenate([self._hist, pcm])
        self.samples_in += len(pcm)
        if self.detector is None:
            opened = []
            if self.turn is None:
                self.turn = self._new_turn(self.samples_in - len(pcm))
                opened.append(TurnOpened(self.turn))
            self._feed(self.samples_in)
            self._trim(self.turn.fed)
            return opened
        events = []
        for ev in self.detector.push(pcm):
            at = self._vad_origin + ev.audio_ms * MS
            if ev.type == "speech_started" and self.turn is None:
                self.turn = self._new_turn(at)
                events.append(SpeechStarted(at // MS, self.turn))
            elif ev.type == "speech_stopped" and self.turn is not None:
                self._feed(at)
                turn = self._close_turn()
                events.append(SpeechStopped(at // MS, at - self.vad.silence_duration_ms * MS, turn))
        judged = self._vad_origin + self.detector.frames * VAD_FRAME_SAMPLES
        if self.turn is not None:
            self._feed(min(judged, self.samples_in))
        keep = judged - (self.vad.prefix_padding_ms * MS + 2 * VAD_FRAME_SAMPLES)
        self._trim(min(keep, self.turn.fed) if self.turn is not None else keep)
        return events

    def commit(self) -> TurnAudio | None:
        """End the open turn here (manual commit); detection restarts after it."""
        if self.turn is None:
            return None
        self._feed(self.samples_in)
        turn = self._close_turn()
        self.set_vad(self.vad)
        return turn

    def clear(self) -> None:
        self.turn = None
        self._hist, self._hist_start = self._hist[:0], self.samples_in
        self.set_vad(self.vad)

    # ---- internals ----------------------------------------------------------------------------
    def _new_turn(self, start: int) -> TurnAudio:
        return TurnAudio(self.window_factory(), max(start, self._hist_start), self.peak)

    def _feed(self, end: int) -> None:
        t = self.turn
        if end > t.fed:
            t.push(self._hist[t.fed - self._hist_start:end - self._hist_start])

    def _close_turn(self) -> TurnAudio:
        turn, self.turn = self.turn, None
        turn.finish()
        self.peak = turn.peak
        return turn

    def _trim(self, keep_from: int) -> None:
        cut = min(max(0, keep_from - self._hist_start), len(self._hist))
        if cut:
            self._hist, self._hist_start = self._hist[cut:], self._hist_start + cut


def decode_appends(datas: list) -> list:  # worker thread
    """Each append's base64 as samples, or what is wrong with it."""
    out = []
    for data in datas:
        try:
            if isinstance(data, Exception):
                raise data
            out.append(decode_pcm16(data, "audio"))
        except Exception as e:
            out.append(e)
    return out


def audio_jobs(pcms: list, limit: int = PIECE_SAMPLES):
    """Appends' samples (or what is wrong with each) as worker jobs of at most `limit` samples,
    in order: [(append index, samples or the error)]; a long append is cut, short ones are joined."""
    job, room = [], limit
    for i, pcm in enumerate(pcms):
        if isinstance(pcm, Exception):
            job.append((i, pcm))
            continue
        start = 0
        while True:  # an empty append is a piece too: it is answered like any
            n = min(len(pcm) - start, room)
            job.append((i, pcm[start:start + n]))
            start, room = start + n, room - n
            if room == 0:
                yield job
                job, room = [], limit
            if start >= len(pcm):
                break
    if job:
        yield job
