"""A realtime session: what every session kind shares, and what the turn-based kinds share. The
hub picks the kind once, when the session starts, from the served model:

  listening.py  `ListeningSession` (a `ChatModel`, Qwen3-Omni): input audio, turns, VAD,
                the next response's open prompt, barge-in, audio items
  speaking.py   `SpeakingSession` (text-to-speech, S2): text items in, speech out; audio input is
                refused with an `error` event (`audio_input_unsupported`)
  duplex.py     `DuplexSession` (a `DuplexModel`, Moshi): one open-ended response that speaks while
                the user's appends stream in; every turn-based event is refused (`duplex_session`)

`RealtimeSession` is what they all share: the outbox, the fair share of the workers, the
client-event table (`handlers`), `busy` (the hub's idle bound and a drain's count ask it).
`working` (a drain's count) and `cut` (the drain's timeout) are the kinds' too.
`TurnSession` is what the two turn-based kinds share: the settings, `Conversation`
(conversation.py) the items and conversation.item.*, `Responses` (response.py) one response at a
time. `Outbox` (outbox.py) is what the client is told; `ClientEvents` (dispatch.py) hands each
client event, in order, to the handler the kind names for it. The audio work of appends runs in
worker threads, and a response's events are forwarded by their own task meanwhile.

Fair share of the realtime workers (`--realtime-workers`): a session has at most one job in the
pool at a time (`work`: its events are handled in order, each waiting for its job), and a job
holds at most PIECE_SAMPLES of audio (`ListeningSession.on_appends`). The pool runs jobs first
come, first served, so while a session's long append goes through piece by piece, every other
session's next job runs after at most one piece of it: round-robin between the sessions that have
work.
"""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Any, Awaitable, Callable

from omnivox.api.realtime.conversation import Conversation, Item, ItemSpec
from omnivox.api.realtime.host import SessionHost
from omnivox.api.realtime.outbox import Outbox
from omnivox.api.realtime.protocol import (BETA, GA, Dialect, Generation, ProtocolError, SessionConfig,
                                           generation_json, new_id, parse_session_update, session_json)
from omnivox.api.realtime.response import Responses
from omnivox.engine.handle import RequestHandle
from omnivox.errors import InputError
from omnivox.serving import MAX_CHARS_PER_TOKEN

Handler = Callable[[dict], Awaitable[None]]  # one client event type's handler (`handlers`)
HangUp = Callable[[int, str], Awaitable[None]]  # close the socket with (code, reason); the session then ends


async def unsupported(event: dict) -> None:
    """The handler of a client event only WebRTC/SIP carry."""
    raise ProtocolError(f"{event['type']} is not supported over WebSocket (WebRTC/SIP only)",
                        code="unsupported_event")


class RealtimeSession(ABC):
    """One client's session: what every kind does. `hang_up` closes its socket (the hub's). What a
    kind refuses it raises as ProtocolError (InputError from the model's checks), and
    `Outbox.report` answers it with an `error` event: the session goes on."""

    def __init__(self, host: SessionHost, send: Callable[[str], Awaitable[None]], beta: bool, hang_up: HangUp):
        self.host, self.hang_up = host, hang_up
        self.dialect: Dialect = BETA if beta else GA
        self.model, self.metrics = host.model, host.metrics
        self.id, self.conversation_id = new_id("sess"), new_id("conv")
        self.loop = asyncio.get_running_loop()
        self.out = Outbox(send, self.dialect, self.metrics)
        self._job = asyncio.Lock()  # one worker job at a time: the fair share (see the module's doc)

    async def work(self, fn, *args):
        """`fn(*args)` in a realtime worker, once the session's job before it is done (the fair share)."""
        async with self._job:
            return await self.host.pool.run(fn, *args)

    def _append_data(self, event: dict) -> Any:
        """An append's base64 audio, or the ProtocolError refusing one over `max_append_bytes` (15 MiB)."""
        data = event.get("audio")
        limit = self.host.limits.max_append_bytes
        if isinstance(data, str) and len(data) > limit:
            return ProtocolError(f"input_audio_buffer.append carries {len(data)} base64 characters; at most {limit} "
                                 "are accepted per event: send the audio in smaller pieces", param="audio",
                                 code="input_audio_too_large")
        return data

    @property
    def host_bytes(self) -> int:
        """Host memory the session holds for its audio (none by default)."""
        return 0

    @property
    def open_pages(self) -> int:
        """KV pages the session holds while no response of it runs (the hub's turns' share, which
        only a listening session's open prompt takes)."""
        return 0

    # ---- the session's life -------------------------------------------------------------------
    def open(self) -> None:
        """Before the connection is accepted: what the session needs of the engine at once
        (OmnivoxError: the connection is refused, Overloaded with 1013). Nothing by default."""

    async def start(self) -> None:
        await self.out.send({"type": "session.created", "session": self.session_json()})
        if self.dialect.beta:
            await self.out.send({"type": "conversation.created",
                                 "conversation": {"id": self.conversation_id, "object": "realtime.conversation"}})

    async def close(self) -> None:
        """The client went away: every engine request of the session is cancelled (pages freed)."""
        self.out.closed = True

    @property
    def working(self) -> bool:
        """Whether a drain waits for the session (`lifecycle.Lifecycle.working`): while `busy` unless
        the kind says otherwise."""
        return self.busy

    def cut(self, reason: str) -> None:
        """The drain's timeout (`RealtimeHub.cut`, on the event loop). Nothing by default: the
        engine's own cut fails a turn-based session's response (an `error`, then response.done)."""

    # ---- what the kinds fill in ---------------------------------------------------------------
    @property
    @abstractmethod
    def busy(self) -> bool:
        """Whether the session works for its client now: the hub's idle bound waits while it does
        (a client listening to a long reply, or waiting for its frames, is not idle)."""

    @abstractmethod
    def handlers(self) -> dict[str, Handler]:
        """Client event type -> its handler (`dispatch.ClientEvents`; appends go to `on_appends`)."""

    @abstractmethod
    def session_json(self) -> dict[str, Any]:
        """The session object of session.created / session.updated."""

    @abstractmethod
    async def on_appends(self, batch: list[tuple[dict, float]]) -> None:
        """Queued `input_audio_buffer.append` events (with when each was read), taken together;
        each one that fails is answered with an `error` event of its own (`out.report`)."""


class TurnSession(RealtimeSession):
    """A turn-based session (listening, speaking): its settings, its conversation, one response at
    a time. A kind fills in the methods under "what the kinds fill in" (each says what it owes), on
    the event loop unless it says otherwise, and may extend `close`."""

    def __init__(self, host: SessionHost, send: Callable[[str], Awaitable[None]], beta: bool, hang_up: HangUp):
        super().__init__(host, send, beta, hang_up)
        self.voices = [v.lower() for v in host.model.builtin_voices]
        self.default_voice = host.model.default_voice
        # server VAD on (the kind may drop it); every value within the server's output limits
        self.cfg = SessionConfig(gen=Generation().within(host.output), audio_window_s=host.limits.audio_window_s)
        self.conversation = Conversation(self)
        self.responses = Responses(self)

    def handlers(self) -> dict[str, Handler]:
        c, r = self.conversation, self.responses
        return {"session.update": self.on_session_update,
                "input_audio_buffer.commit": self.on_commit,
                "input_audio_buffer.clear": self.on_clear,
                "conversation.item.create": c.on_create,
                "conversation.item.truncate": c.on_truncate,
                "conversation.item.delete": c.on_delete,
                "conversation.item.retrieve": c.on_retrieve,
                "response.create": r.on_create,
                "response.cancel": r.on_cancel,
                "output_audio_buffer.clear": unsupported}

    @property
    def busy(self) -> bool:
        return self.responses.run is not None  # a response being generated or sent

    def session_json(self) -> dict[str, Any]:
        ext = {**generation_json(self.cfg), "default_voice": self.default_voice, **self._omnivox_json()}
        return session_json(self.id, self.host.served_name, self.cfg, self.dialect, ext,
                            self.cfg.gen.voice or self.default_voice)

    async def close(self) -> None:
        await super().close()
        self.responses.cancel()

    # ---- settings -----------------------------------------------------------------------------
    async def on_session_update(self, event: dict) -> None:
        cfg = parse_session_update(event.get("session"), self.cfg, self.voices, self.host.limits.max_window_s)
        cfg = replace(cfg, gen=cfg.gen.within(self.host.output))
        await self.check_generation(cfg.gen, "session")
        self.cfg = self._adopt(cfg)
        await self.out.send({"type": "session.updated", "session": self.session_json()})
        self.sync()

    def check_text(self, text: str, param: str) -> None:
        """Refuse text that cannot fit the model's context before anything tokenizes it (the HTTP
        routes' pre-check: at most MAX_CHARS_PER_TOKEN characters per context token)."""
        context = self.model.max_model_len
        if context and len(text) > MAX_CHARS_PER_TOKEN * context:
            raise ProtocolError(f"{param} holds {len(text)} characters, more than can fit the model's context of "
                                f"{context} tokens (at most {MAX_CHARS_PER_TOKEN} characters per token)",
                                param=param, code="input_too_long")

    async def check_generation(self, gen: Generation, param: str) -> None:
        """Everything a response would refuse in `gen`, refused now: session.update and
        response.create share this, so a session never holds settings its responses cannot use.
        Sizes in characters on the loop; the model's own option checks (sampling ranges, the Talker
        instruction in characters, then tokens) and the tokenizing of the instructions in a worker
        (`_tokenizes`), or at once when nothing needs tokenizing."""
        self.check_text(gen.instructions, f"{param}.instructions")
        for name in ("text_temperature", "text_top_k"):
            if getattr(gen, name) is not None:
                raise ProtocolError(f"{param}.omnivox.{name} is a full-duplex session's (its text tokens' sampling)",
                                    param=f"{param}.omnivox.{name}", code="unsupported_feature")
        try:
            if self._tokenizes(gen):
                await self.work(self._model_checks, gen)
            else:  # nothing to tokenize: range checks only, without waiting for a worker
                self._model_checks(gen)
        except InputError as e:
            where = e.param if e.param in ("instructions", "voice") else f"omnivox.{e.param}" if e.param else None
            raise ProtocolError(str(e), param=f"{param}.{where}" if where else None,
                                code=e.code or "invalid_value") from None

    def _tokenizes(self, gen: Generation) -> bool:
        """Whether `_model_checks(gen)` tokenizes (then it runs in a worker)."""
        return bool(gen.talker_instruction)

    # ---- what the kinds fill in (see the class's doc) -----------------------------------------
    @abstractmethod
    async def on_commit(self, event: dict) -> None:
        """`input_audio_buffer.commit`."""

    @abstractmethod
    async def on_clear(self, event: dict) -> None:
        """`input_audio_buffer.clear`."""

    @abstractmethod
    async def text_ids(self, text: str) -> list[int] | None:
        """A user text item's token ids (None: the kind keeps none)."""

    @abstractmethod
    async def audio_item(self, spec: ItemSpec) -> Item:
        """A user audio item of conversation.item.create."""

    @abstractmethod
    def _adopt(self, cfg: SessionConfig) -> SessionConfig:
        """A checked session.update's settings, applied to the kind's parts; returns what is kept."""

    @abstractmethod
    def _model_checks(self, gen: Generation) -> None:
        """The model's checks of `gen` (InputError), tokenizing what they read; a worker thread when
        `_tokenizes(gen)`."""

    @abstractmethod
    async def engine_request(self, gen: Generation) -> tuple[RequestHandle, int, float | None]:
        """The engine request of a response now: (its handle, the audio rows in its prompt, when the
        user's speech it answers ended (None: no spoken turn; TTFA's start))."""

    def sync(self) -> None:
        """Called after each change to the conversation or the settings and after each response:
        keep what the next response reads up to date (nothing to keep by default)."""

    @abstractmethod
    def _omnivox_json(self) -> dict[str, Any]:
        """The kind's fields of session.omnivox (`listens` at least)."""

