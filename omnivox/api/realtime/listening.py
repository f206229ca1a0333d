"""A listening session (a `ChatModel`, Qwen3-Omni): the user speaks, the model answers.

Input audio goes through `audio_input.InputAudio` in worker jobs (the fair share: appends are
decoded in one job, then processed in jobs of at most PIECE_SAMPLES, `audio_jobs`), which finds
the turns: server VAD's speech_started / speech_stopped, or in manual mode a turn opened by its
first audio and ended by `input_audio_buffer.commit`.

The open turn's rows stream into the next response's engine request while the user speaks
(`pending.OpenPrompt`, `sync`), within the room the hub leaves it of the turns' KV share
(`host.turn_room`; refused once with a `turn_kv_budget` error, the turn then computed when its
response starts) and given back after --realtime-turn-idle-s without input (`_release_idle`).
speech_started during a response cancels it (barge-in) when `interrupt_response` is on.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, Awaitable, Callable

from omnivox.api.realtime.audio_input import (MS, PCM_RATE, PIECE_SAMPLES, InputAudio, SpeechStarted, SpeechStopped,
                                              TurnAudio, TurnOpened, audio_jobs, decode_appends, decode_pcm16)
from omnivox.api.realtime.conversation import AudioItem, Item, ItemSpec
from omnivox.api.realtime.host import SessionHost
from omnivox.api.realtime.pending import OpenPrompt
from omnivox.api.realtime.protocol import Generation, ProtocolError, SessionConfig, new_id
from omnivox.api.realtime.session import HangUp, TurnSession
from omnivox.engine.handle import RequestHandle
from omnivox.errors import OmnivoxError, message_of

MIN_COMMIT_MS = 100  # OpenAI's smallest committed buffer


class ListeningSession(TurnSession):
    def __init__(self, host: SessionHost, send: Callable[[str], Awaitable[None]], beta: bool, hang_up: HangUp):
        super().__init__(host, send, beta, hang_up)
        self.layout = self.model.conversation_layout()
        self.audio = InputAudio(self._window, self.cfg.turn_detection, host.limits.max_turn_samples,
                                vad_model=host.vad_model)
        self.pending = OpenPrompt(self.model, self.layout, self.id, self.loop)
        self.turn: TurnAudio | None = None  # the open user turn, as the event loop knows it
        self.turn_id: str | None = None  # the user item it becomes
        self.speech_end: float | None = None  # when the last committed turn's speech ended (TTFA's start)
        self._unsynced: str | None = None  # the turn whose engine request could not be opened
        self._arrivals: deque[tuple[int, float]] = deque()  # (input samples after an append, its arrival)
        self._idle: asyncio.TimerHandle | None = None  # gives back an open prompt's pages (--realtime-turn-idle-s)

    def _window(self):
        return self.host.audio_window(self.cfg.audio_window_s)

    def _omnivox_json(self) -> dict[str, Any]:
        return {"listens": True, "audio_window_chunks": self._window().window_chunks}

    @property
    def open_pages(self) -> int:
        return self.pending.pages

    @property
    def host_bytes(self) -> int:
        """Its audio on the host: every user turn's pieces and rows, the open turn's, the input history."""
        turns = [it.turn for it in list(self.conversation.items) if isinstance(it, AudioItem)]
        if self.audio.turn is not None:
            turns.append(self.audio.turn)
        return sum(t.host_bytes for t in turns) + self.audio.history_bytes

    async def close(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        await super().close()
        self.pending.cancel()

    def _adopt(self, cfg: SessionConfig) -> SessionConfig:
        if cfg.turn_detection != self.cfg.turn_detection:
            self.audio.set_vad(cfg.turn_detection)
        return cfg

    # ---- input audio --------------------------------------------------------------------------
    def _append_pieces(self, job: list[tuple[int, Any]], failed: set[int]) -> list[tuple[int, Any]]:  # worker
        """A job of `audio_jobs`: each piece of audio through the session's input in order, as (append
        index, (samples, samples in after it, its events)) or (append index, what went wrong). An
        append that failed takes no more pieces (`failed`: the loop hands it over for the job)."""
        out = []
        for i, pcm in job:
            if i in failed:
                continue
            try:
                if isinstance(pcm, Exception):
                    raise pcm
                found = self.audio.append(pcm)
                out.append((i, (len(pcm), self.audio.samples_in, found)))
            except Exception as e:
                failed.add(i)
                out.append((i, e))
        return out

    async def on_appends(self, batch: list[tuple[dict, float]]) -> None:
        """Their base64 decoded in one worker job, then their audio in jobs of at most
        PIECE_SAMPLES each (`audio_jobs`), so that a long append waits its turn between other
        sessions' jobs instead of holding a worker."""
        pcms = await self.work(decode_appends, [self._append_data(event) for event, _ in batch])
        failed: set[int] = set()
        for job in audio_jobs(pcms):
            for i, result in await self.work(self._append_pieces, job, failed):
                event, read_at = batch[i]
                try:
                    if isinstance(result, Exception):
                        raise result
                    await self._appended(*result, read_at)
                except Exception as e:
                    failed.add(i)
                    await self.out.report(e, event)

    async def _appended(self, n: int, samples_in: int, found: list, read_at: float) -> None:
        self.metrics.input_seconds.inc(n / PCM_RATE)
        self._arrivals.append((samples_in, read_at))
        while len(self._arrivals) > 1 and self._arrivals[1][0] < samples_in - 30 * PCM_RATE:
            self._arrivals.popleft()
        for ev in found:
            if isinstance(ev, TurnOpened):  # manual mode: a turn opens with its first audio
                self.turn, self.turn_id = ev.turn, new_id("item")
            elif isinstance(ev, SpeechStarted):
                await self._speech_started(ev)
            else:
                await self._speech_stopped(ev)
        self.sync()

    async def _speech_started(self, ev: SpeechStarted) -> None:
        self.turn, self.turn_id = ev.turn, new_id("item")
        await self.out.send({"type": "input_audio_buffer.speech_started", "audio_start_ms": ev.audio_ms,
                             "item_id": self.turn_id})
        vad = self.cfg.turn_detection
        if self.responses.run is not None and vad is not None and vad.interrupt_response:
            self.metrics.barge_ins.inc()
            await self.responses.run.cancel("turn_detected")

    async def _speech_stopped(self, ev: SpeechStopped) -> None:
        item_id = self.turn_id
        await self.out.send({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": ev.audio_ms,
                             "item_id": item_id})
        self.speech_end = self._arrival_of(ev.speech_end_sample)
        await self._commit(ev.turn)
        vad = self.cfg.turn_detection
        if vad is not None and vad.create_response and self.responses.run is None:
            await self.responses.respond(self.cfg.gen)

    def _arrival_of(self, sample: int) -> float:
        """When the append holding input sample `sample` arrived."""
        for end, t in self._arrivals:
            if end > sample:
                return t
        return time.monotonic()

    async def _commit(self, turn: TurnAudio) -> None:
        item_id, self.turn_id, self.turn = self.turn_id or new_id("item"), None, None
        if turn.samples < MIN_COMMIT_MS * MS or turn.n_rows == 0:
            if self.pending.turn_id == item_id:
                self.pending.cancel()
            raise ProtocolError(f"the input audio buffer holds {turn.samples / MS:.0f} ms; at least {MIN_COMMIT_MS} ms "
                                "are needed to commit", code="input_audio_buffer_commit_empty")
        item = AudioItem(item_id, "user", turn=turn, audio_ms=turn.samples // MS)
        prev = self.conversation.items[-1].id if self.conversation.items else None
        self.conversation.items.append(item)
        self.pending.commit(item)
        self.metrics.turns.inc()
        await self.out.send({"type": "input_audio_buffer.committed", "previous_item_id": prev, "item_id": item.id})
        await self.conversation.added(item)

    async def on_commit(self, event: dict) -> None:
        turn = await self.work(self.audio.commit)
        if turn is None:
            raise ProtocolError(f"the input audio buffer is empty; at least {MIN_COMMIT_MS} ms are needed to commit",
                                code="input_audio_buffer_commit_empty")
        self.speech_end = time.monotonic()
        await self._commit(turn)
        self.sync()

    async def on_clear(self, event: dict) -> None:
        await self.work(self.audio.clear)
        self.turn = self.turn_id = None
        if self.pending.turn_id is not None:
            self.pending.cancel()
        await self.out.send({"type": "input_audio_buffer.cleared"})

    # ---- items --------------------------------------------------------------------------------
    async def text_ids(self, text: str) -> list[int]:
        return await self.work(self.layout.text_ids, text)

    async def audio_item(self, spec: ItemSpec) -> Item:
        param = "item.content[0].audio"
        pcm = await self.work(decode_pcm16, spec.audio, param)
        if not MIN_COMMIT_MS * MS <= len(pcm) <= self.host.limits.max_turn_samples:
            raise ProtocolError(f"an audio item holds {MIN_COMMIT_MS} ms to "
                                f"{self.host.limits.max_turn_samples // PCM_RATE} s of audio", param=param,
                                code="input_audio_too_large" if len(pcm) > MIN_COMMIT_MS * MS else "invalid_value")
        turn = TurnAudio(self._window(), 0, self.audio.peak)
        for at in range(0, len(pcm), PIECE_SAMPLES):  # in pieces, like appends (the fair share)
            await self.work(turn.push, pcm[at:at + PIECE_SAMPLES])
        await self.work(turn.finish)
        self.audio.peak = turn.peak
        return AudioItem(spec.id, "user", turn=turn, audio_ms=len(pcm) // MS)

    # ---- the next response's open prompt -----------------------------------------------------
    def sync(self) -> None:
        """Keep the next response's engine request up to date while a turn is open (or one is held)."""
        if self.responses.run is not None or self.out.closed:
            return
        turn = self.turn  # NOTE: the loop's view; the worker may be feeding it (pieces only ever grow)
        if (turn is None and not self.pending.is_open) or (turn is not None and self._unsynced == self.turn_id):
            return
        try:
            self.pending.sync(self.conversation.items, self.cfg.gen, turn, self.turn_id if turn is not None else None,
                              room=self.host.turn_room(self.id))
        except OmnivoxError as e:  # overloaded, over the turns' KV share: said once; the turn goes on, computed
            self.pending.cancel()  # when its response starts
            self._unsynced = self.turn_id
            asyncio.ensure_future(self.out.tell(message_of(e), code=getattr(e, "code", None) or "server_overloaded"))
        if self._idle is not None:
            self._idle.cancel()
        if self.pending.is_open:
            self._idle = self.loop.call_later(self.host.limits.turn_idle_s, self._release_idle)

    def _release_idle(self) -> None:
        """No input for --realtime-turn-idle-s: the open prompt gives back its KV pages. The turn
        goes on; its next append opens the request again, recomputed (from the prefix cache where
        its pages were not reused meanwhile)."""
        self._idle = None
        if self.responses.run is None and self.pending.is_open:
            self.pending.cancel()
            self.metrics.idle_turns.inc()

    # ---- responses ----------------------------------------------------------------------------
    def _tokenizes(self, gen: Generation) -> bool:
        return super()._tokenizes(gen) or not (self.layout.has_system(self.cfg.gen.instructions)
                                               and self.layout.has_system(gen.instructions))

    def _model_checks(self, gen: Generation) -> None:
        self.model.check_chat(gen.chat_params())
        # tokenized here, read from the layout's cache later: the session's, then this one (newest)
        self.layout.system(self.cfg.gen.instructions)
        self.layout.system(gen.instructions)

    async def engine_request(self, gen: Generation) -> tuple[RequestHandle, int, float | None]:
        speech_end, self.speech_end = self.speech_end, None
        items = self.conversation.items
        handle = self.pending.close(items, gen)
        return handle, sum(it.n_rows for it in items if isinstance(it, AudioItem)), speech_end
