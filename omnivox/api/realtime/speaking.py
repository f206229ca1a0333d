"""A speaking session (a model that is no `ChatModel`, S2): text items in, speech out.

`response.create` voices the user text since the last reply (`ServedModel.speech`), in the
session's voice. The model cannot listen: every input audio event and audio item is refused with
an `error` event (`audio_input_unsupported`), and the session has no turn detection.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Awaitable, Callable

from omnivox.api.realtime.conversation import Item, ItemSpec, TextItem
from omnivox.api.realtime.host import SessionHost
from omnivox.api.realtime.protocol import Generation, ProtocolError, SessionConfig
from omnivox.api.realtime.session import HangUp, TurnSession
from omnivox.engine.handle import RequestHandle


class SpeakingSession(TurnSession):
    def __init__(self, host: SessionHost, send: Callable[[str], Awaitable[None]], beta: bool, hang_up: HangUp):
        super().__init__(host, send, beta, hang_up)
        self.cfg = self._adopt(self.cfg)

    def _omnivox_json(self) -> dict[str, Any]:
        return {"listens": False}

    def _adopt(self, cfg: SessionConfig) -> SessionConfig:
        return replace(cfg, turn_detection=None)  # nothing to detect turns in: it takes no audio

    # ---- input audio: refused -----------------------------------------------------------------
    def _cannot_listen(self) -> ProtocolError:
        return ProtocolError(f"{self.host.served_name!r} is a text-to-speech model: it takes text items "
                             "(conversation.item.create with input_text) and answers in speech; it cannot "
                             "listen to audio", code="audio_input_unsupported")

    async def on_appends(self, batch: list[tuple[dict, float]]) -> None:
        for event, _ in batch:
            await self.out.report(self._cannot_listen(), event)

    async def on_commit(self, event: dict) -> None:
        raise self._cannot_listen()

    async def on_clear(self, event: dict) -> None:
        raise self._cannot_listen()

    async def audio_item(self, spec: ItemSpec) -> Item:
        raise self._cannot_listen()

    async def text_ids(self, text: str) -> None:
        return None  # the text is voiced as it is, never read back as ids

    # ---- responses ----------------------------------------------------------------------------
    def _model_checks(self, gen: Generation) -> None:
        self.model.check_speech(gen.speech_params())

    async def engine_request(self, gen: Generation) -> tuple[RequestHandle, int, float | None]:
        return await self.work(self._speech, self._text_to_speak(), gen), 0, None

    def _text_to_speak(self) -> str:
        texts = []
        for it in reversed(self.conversation.items):
            if it.role == "assistant":
                break
            if isinstance(it, TextItem) and it.role == "user" and it.text.strip():
                texts.append(it.text)
        if not texts:
            raise ProtocolError("nothing to say: add a user message with input_text first (this text-to-speech "
                                "model voices the user's text)", code="nothing_to_say")
        return "\n".join(reversed(texts))

    def _speech(self, text: str, gen: Generation) -> RequestHandle:  # worker thread
        if not gen.audio:
            raise ProtocolError("a text-to-speech model answers in audio: output_modalities must be [\"audio\"]",
                                param="output_modalities")
        return self.model.speech(text, gen.speech_params(), voice=gen.voice, loop=self.loop)
