"""One realtime session: client events in order, the conversation, the input audio, one response at
a time.

Client events are handled one after another, in the order the client sent them (the socket's
reader queues them in an `Inbox` and keeps reading meanwhile); the audio work of appends runs in
worker threads, and a response's events are forwarded by their own task meanwhile.

Fair share of the realtime workers (`--realtime-workers`): a session has at most one job in the
pool at a time (its events are handled in order, each waiting for its job), and a job holds at most
PIECE_SAMPLES of audio (the appends queued at that moment, cut or joined to that size). The pool
runs jobs first come, first served, so while a session's long append goes through piece by piece,
every other session's next job runs after at most one piece of it: round-robin between the
sessions that have work.

Listening models (`family.chat`): the open turn's rows stream into the next response's engine
request while the user speaks (`pending.OpenPrompt`); speech_started during a response cancels it
(barge-in) when `interrupt_response` is on. Text-to-speech models: text items in, speech out;
audio input is refused with an `error` event.
"""
from __future__ import annotations

import asyncio
import json
import time
import traceback
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Awaitable, Callable


from omnivox.api.realtime.audio_input import (MS, PCM_RATE, PIECE_SAMPLES, InputAudio, SpeechStarted, SpeechStopped,
                                              TurnAudio, TurnOpened, audio_jobs, decode_appends, decode_pcm16)
from omnivox.api.realtime.conversation import AudioItem, ChatLayout, Item, ReplyItem, TextItem, new_id, parse_item
from omnivox.api.realtime.inbox import BIG_MESSAGE, Inbox, loads_big
from omnivox.api.realtime.pending import OpenPrompt, engine_options
from omnivox.api.realtime.protocol import (BETA, GA, Dialect, Generation, ProtocolError, SessionConfig, error_event,
                                           parse_response_params, parse_session_update, session_json)
from omnivox.api.realtime.response import ResponseRun
from omnivox.errors import InputError, OmnivoxError, message_of
from omnivox.models.qwen3_omni.processor import MAX_CHARS_PER_TOKEN

if TYPE_CHECKING:
    from omnivox.api.realtime.hub import RealtimeHub

MIN_COMMIT_MS = 100  # OpenAI's smallest committed buffer
APPEND = "input_audio_buffer.append"
MAX_APPEND_BATCH = 256  # queued appends handled together (their audio in jobs of PIECE_SAMPLES)


class RealtimeSession:
    def __init__(self, hub: "RealtimeHub", send: Callable[[str], Awaitable[None]], beta: bool):
        self.hub, self._send_text = hub, send
        self.dialect: Dialect = BETA if beta else GA
        self.model, self.metrics = hub.model, hub.metrics
        self.id, self.conversation_id = new_id("sess"), new_id("conv")
        self.loop = asyncio.get_running_loop()
        self.listens = bool(hub.model.family.chat)
        self.voices = [v.lower() for v in hub.model.builtin_voices]
        self.default_voice = self.voices[0] if self.voices == ["default"] else (
            "ethan" if "ethan" in self.voices else (self.voices[0] if self.voices else None))
        self.cfg = SessionConfig(audio_window_s=hub.limits.audio_window_s,
                                 turn_detection=SessionConfig().turn_detection if self.listens else None)
        self.items: list[Item] = []
        self.run: ResponseRun | None = None
        self.turn: TurnAudio | None = None  # the open user turn, as the event loop knows it
        self.turn_id: str | None = None  # the user item it becomes
        self.speech_end: float | None = None  # when the last committed turn's speech ended (TTFA's start)
        self.closed = False
        self._unsynced: str | None = None  # the turn whose engine request could not be opened
        self._arrivals: deque[tuple[int, float]] = deque()  # (input samples after an append, its arrival)
        self._job = asyncio.Lock()  # one worker job at a time: the fair share (see the module's doc)
        self._idle: asyncio.TimerHandle | None = None  # gives back an open prompt's pages (--realtime-turn-idle-s)
        if self.listens:
            self.layout = ChatLayout(self.model)
            self.audio = InputAudio(self._encoder, self.cfg.turn_detection, hub.limits.max_turn_samples,
                                    vad_model=hub.vad_model)
            self.pending = OpenPrompt(self.model, self.layout, self.id, self.loop)

    # ---- plumbing -----------------------------------------------------------------------------
    async def send(self, event: dict[str, Any]) -> None:
        name = self.dialect.name(event["type"])
        if name is None or self.closed:
            return
        event = {"type": name, "event_id": new_id("event"), **{k: v for k, v in event.items() if k != "type"}}
        await self._send_text(json.dumps(event))

    async def error(self, message: str, *, code: str, param: str | None = None, event_id: str | None = None) -> None:
        self.metrics.errors.inc(code=code)
        await self.send(error_event(message, code=code, param=param, event_id=event_id))

    async def _tell(self, message: str, *, code: str) -> None:
        """An error event sent from a task of its own (a client gone meanwhile is not an error)."""
        try:
            await self.error(message, code=code)
        except ConnectionError:
            pass

    async def _work(self, fn, *args):
        async with self._job:
            return await self.hub.pool.run(fn, *args)

    def _encoder(self):
        return self.hub.encoder(self.cfg.audio_window_s)

    def previous_id(self, item: Item) -> str | None:
        i = self.items.index(item) if item in self.items else len(self.items)
        return self.items[i - 1].id if i > 0 else None

    def session_json(self) -> dict[str, Any]:
        extra = {"default_voice": self.default_voice, "listens": self.listens}
        if self.listens:
            extra["audio_window_chunks"] = self._encoder().window_chunks
        return session_json(self.id, self.hub.served_name, self.cfg, self.dialect, extra)

    # ---- the session's life -------------------------------------------------------------------
    async def start(self) -> None:
        await self.send({"type": "session.created", "session": self.session_json()})
        if self.dialect.beta:
            await self.send({"type": "conversation.created",
                             "conversation": {"id": self.conversation_id, "object": "realtime.conversation"}})

    async def close(self) -> None:
        """The client went away: every engine request of the session is cancelled (pages freed)."""
        self.closed = True
        if self._idle is not None:
            self._idle.cancel()
        if self.run is not None:
            self.run.handle.cancel()
            if self.run.task is not None:
                self.run.task.cancel()
        if self.listens:
            self.pending.cancel()

    async def handle(self, inbox: Inbox) -> None:
        """Client events in order until the inbox closes (the reader saw the client go away); each
        failure is answered with an `error` event. Appends queued behind one another are taken
        together (`on_appends`): a session that fell behind catches up in one worker job."""
        held = None  # an event read while gathering appends, handled next
        while True:
            if held is None:
                message = await inbox.get()
                if message is None:
                    return
                held = (await self._parse(message[0]), message[1])
            (event, read_at), held = held, None
            if not _is_append(event):
                await self._guarded(self._dispatch, event)
                continue
            batch = [(event, read_at)]
            while len(batch) < MAX_APPEND_BATCH and (message := inbox.take_ready()) is not None:
                nxt = (await self._parse(message[0]), message[1])
                if not _is_append(nxt[0]):
                    held = nxt
                    break
                batch.append(nxt)
            await self._guarded(self.on_appends, batch)

    async def _parse(self, raw: str | bytes) -> dict | Exception:
        """A client event, or what is wrong with it (answered in its turn)."""
        try:
            if isinstance(raw, bytes):
                raise ProtocolError("send client events as JSON text frames (binary frames are not accepted)",
                                    code="invalid_event")
            event = await self._work(loads_big, raw) if len(raw) > BIG_MESSAGE else json.loads(raw)
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                raise ProtocolError("a client event is a JSON object with a string `type`", code="invalid_event")
            return event
        except json.JSONDecodeError as e:
            return e
        except ValueError:  # int() of a number past Python's 4,300-digit limit
            return ProtocolError("a number in the message is too long", code="invalid_json")
        except (RecursionError, OmnivoxError) as e:
            return e

    async def _dispatch(self, event: dict | Exception) -> None:
        if isinstance(event, Exception):
            raise event
        handler = HANDLERS.get(event["type"])
        if handler is None:
            raise ProtocolError(f"unknown event type {event['type']!r:.80}", param="type", code="unknown_event")
        await handler(self, event)

    async def _guarded(self, handler, arg) -> None:
        try:
            await handler(arg)
        except Exception as e:
            await self._report(e, _event_id(arg))

    async def _report(self, e: Exception, event_id: str | None) -> None:
        if isinstance(e, ConnectionError):  # the client went away (`send`): nothing to tell, the session ends
            raise e
        if isinstance(e, json.JSONDecodeError):
            await self.error(f"the message is not valid JSON: {e}", code="invalid_json")
        elif isinstance(e, RecursionError):
            await self.error("the message is nested too deeply", code="invalid_json")
        elif isinstance(e, OmnivoxError):  # ProtocolError, InputError (bad audio, options), Overloaded, ...
            code = getattr(e, "code", None) or ("server_overloaded" if getattr(e, "status", 400) == 503
                                                else "invalid_value")
            await self.error(str(e), code=code, param=getattr(e, "param", None), event_id=event_id)
        else:  # a bug fails this event only: the traceback goes to the log, the session goes on
            traceback.print_exception(e)
            await self.error(message_of(e), code="server_error", event_id=event_id)

    # ---- session.update -----------------------------------------------------------------------
    async def on_session_update(self, event: dict) -> None:
        cfg = parse_session_update(event.get("session"), self.cfg, self.voices, self.hub.limits.max_window_s)
        await self._check_generation(cfg.gen, "session")
        if not self.listens:  # nothing to detect turns in: it takes no audio
            cfg = replace(cfg, turn_detection=None)
        if self.listens and cfg.turn_detection != self.cfg.turn_detection:
            self.audio.set_vad(cfg.turn_detection)
        self.cfg = cfg
        await self.send({"type": "session.updated", "session": self.session_json()})
        self._sync()

    # ---- input audio --------------------------------------------------------------------------
    def _require_listening(self) -> None:
        if not self.listens:
            raise ProtocolError(f"{self.hub.served_name!r} is a text-to-speech model: it takes text items "
                                "(conversation.item.create with input_text) and answers in speech; it cannot "
                                "listen to audio", code="audio_input_unsupported")

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
        """`input_audio_buffer.append` events (with when each was read): their base64 decoded in
        one worker job, then their audio in jobs of at most PIECE_SAMPLES each (`audio_jobs`), so that
        a long append waits its turn between other sessions' jobs instead of holding a worker."""
        pcms = await self._work(decode_appends, [self._append_data(event) for event, _ in batch])
        failed: set[int] = set()
        for job in audio_jobs(pcms):
            for i, result in await self._work(self._append_pieces, job, failed):
                event, read_at = batch[i]
                try:
                    if isinstance(result, Exception):
                        raise result
                    await self._appended(*result, read_at)
                except Exception as e:
                    failed.add(i)
                    await self._report(e, _event_id(event))

    def _append_data(self, event: dict) -> Any:
        try:
            self._require_listening()
            data = event.get("audio")
            limit = self.hub.limits.max_append_bytes
            if isinstance(data, str) and len(data) > limit:
                raise ProtocolError(f"input_audio_buffer.append carries {len(data)} base64 characters; at most {limit} "
                                    "are accepted per event: send the audio in smaller pieces", param="audio",
                                    code="input_audio_too_large")
            return data
        except ProtocolError as e:
            return e

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
        self._sync()

    async def _speech_started(self, ev: SpeechStarted) -> None:
        self.turn, self.turn_id = ev.turn, new_id("item")
        await self.send({"type": "input_audio_buffer.speech_started", "audio_start_ms": ev.audio_ms,
                         "item_id": self.turn_id})
        vad = self.cfg.turn_detection
        if self.run is not None and vad is not None and vad.interrupt_response:
            self.metrics.barge_ins.inc()
            await self.run.cancel("turn_detected")

    async def _speech_stopped(self, ev: SpeechStopped) -> None:
        item_id = self.turn_id
        await self.send({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": ev.audio_ms,
                         "item_id": item_id})
        self.speech_end = self._arrival_of(ev.speech_end_sample)
        await self._commit(ev.turn)
        vad = self.cfg.turn_detection
        if vad is not None and vad.create_response and self.run is None:
            await self._respond(self.cfg.gen)

    def _arrival_of(self, sample: int) -> float:
        """When the append holding input sample `sample` arrived."""
        for end, t in self._arrivals:
            if end > sample:
                return t
        return time.monotonic()

    async def _commit(self, turn: TurnAudio) -> None:
        item_id, self.turn_id, self.turn = self.turn_id or new_id("item"), None, None
        if turn.samples < MIN_COMMIT_MS * MS or turn.n_rows == 0:
            if self.listens and self.pending.turn_id == item_id:
                self.pending.cancel()
            raise ProtocolError(f"the input audio buffer holds {turn.samples / MS:.0f} ms; at least {MIN_COMMIT_MS} ms "
                                "are needed to commit", code="input_audio_buffer_commit_empty")
        item = AudioItem(item_id, "user", rows=turn.all_rows(), audio_ms=turn.samples // MS)
        prev = self.items[-1].id if self.items else None
        self.items.append(item)
        self.pending.commit(item)
        self.metrics.turns.inc()
        await self.send({"type": "input_audio_buffer.committed", "previous_item_id": prev, "item_id": item.id})
        await self._item_added(item)

    async def on_commit(self, event: dict) -> None:
        self._require_listening()
        turn = await self._work(self.audio.commit)
        if turn is None:
            raise ProtocolError(f"the input audio buffer is empty; at least {MIN_COMMIT_MS} ms are needed to commit",
                                code="input_audio_buffer_commit_empty")
        self.speech_end = time.monotonic()
        await self._commit(turn)
        self._sync()

    async def on_clear(self, event: dict) -> None:
        self._require_listening()
        await self._work(self.audio.clear)
        self.turn = self.turn_id = None
        if self.pending.turn_id is not None:
            self.pending.cancel()
        await self.send({"type": "input_audio_buffer.cleared"})

    # ---- the conversation ---------------------------------------------------------------------
    async def _item_added(self, item: Item) -> None:
        prev = self.previous_id(item)
        await self.send({"type": "conversation.item.added", "previous_item_id": prev, "item": item.to_json(self.dialect)})
        await self.send({"type": "conversation.item.done", "previous_item_id": prev, "item": item.to_json(self.dialect)})

    def _find(self, item_id: Any, param: str = "item_id") -> Item:
        for it in self.items:
            if it.id == item_id:
                return it
        raise ProtocolError(f"no conversation item {item_id!r:.80}", param=param, code="item_not_found")

    async def on_item_create(self, event: dict) -> None:
        spec = parse_item(event.get("item"), {it.id for it in self.items})
        if spec.audio is None:
            self._check_text(spec.text, "item.content")
            ids = await self._work(self.layout.text_ids, spec.text) if self.listens else None
            item: Item = TextItem(spec.id, spec.role, text=spec.text, ids=ids)
        else:
            self._require_listening()
            param = "item.content[0].audio"
            pcm = await self._work(decode_pcm16, spec.audio, param)
            if not MIN_COMMIT_MS * MS <= len(pcm) <= self.hub.limits.max_turn_samples:
                raise ProtocolError(f"an audio item holds {MIN_COMMIT_MS} ms to "
                                    f"{self.hub.limits.max_turn_samples // PCM_RATE} s of audio", param=param,
                                    code="input_audio_too_large" if len(pcm) > MIN_COMMIT_MS * MS else "invalid_value")
            turn = TurnAudio(self._encoder(), 0, self.audio.peak)
            for at in range(0, len(pcm), PIECE_SAMPLES):  # in pieces, like appends (the fair share)
                await self._work(turn.push, pcm[at:at + PIECE_SAMPLES])
            await self._work(turn.finish)
            self.audio.peak = turn.mel.peak
            item = AudioItem(spec.id, "user", rows=turn.all_rows(), audio_ms=len(pcm) // MS)
        self._insert(item, event.get("previous_item_id"))
        await self._item_added(item)
        self._sync()

    def _insert(self, item: Item, previous: Any) -> None:
        if previous is None:
            self.items.append(item)
        elif previous == "root":
            self.items.insert(0, item)
        else:
            self.items.insert(self.items.index(self._find(previous, "previous_item_id")) + 1, item)

    async def on_item_truncate(self, event: dict) -> None:
        item = self._find(event.get("item_id"))
        if not isinstance(item, ReplyItem) or not item.audio:
            raise ProtocolError("only an assistant reply with audio can be truncated", param="item_id",
                                code="invalid_item")
        end = event.get("audio_end_ms")
        if isinstance(end, bool) or not isinstance(end, int) or end < 0:
            raise ProtocolError("audio_end_ms must be a non-negative integer", param="audio_end_ms")
        if event.get("content_index", 0) != 0:
            raise ProtocolError("content_index must be 0", param="content_index")
        if self.run is not None and self.run.item is item:  # still speaking: what comes next is unheard
            await self.run.cancel("client_cancelled")
        if end > item.audio_ms:
            raise ProtocolError(f"audio_end_ms {end} is past the end of the item's audio ({item.audio_ms} ms)",
                                param="audio_end_ms")
        item.truncate(end)
        await self.send({"type": "conversation.item.truncated", "item_id": item.id, "content_index": 0,
                         "audio_end_ms": end})
        self._sync()

    async def on_item_delete(self, event: dict) -> None:
        item = self._find(event.get("item_id"))
        if self.run is not None and self.run.item is item:
            raise ProtocolError("the reply of the active response cannot be deleted; cancel the response first",
                                param="item_id")
        self.items.remove(item)
        await self.send({"type": "conversation.item.deleted", "item_id": item.id})
        self._sync()

    async def on_item_retrieve(self, event: dict) -> None:
        item = self._find(event.get("item_id"))
        await self.send({"type": "conversation.item.retrieved", "item": item.to_json(self.dialect)})

    # ---- responses ----------------------------------------------------------------------------
    def _sync(self) -> None:
        """Keep the next response's engine request up to date while a turn is open (or one is held)."""
        if not self.listens or self.run is not None or self.closed:
            return
        turn = self.turn  # NOTE: the loop's view; the worker may be feeding it (rows only ever grow)
        if (turn is None and not self.pending.is_open) or (turn is not None and self._unsynced == self.turn_id):
            return
        try:
            self.pending.sync(self.items, self.cfg.gen, turn, self.turn_id if turn is not None else None,
                              room=self.hub.turn_room(self))
        except OmnivoxError as e:  # overloaded, over the turns' KV share: said once; the turn goes on, computed
            self.pending.cancel()  # when its response starts
            self._unsynced = self.turn_id
            asyncio.ensure_future(self._tell(message_of(e), code=getattr(e, "code", None) or "server_overloaded"))
        if self._idle is not None:
            self._idle.cancel()
        if self.pending.is_open:
            self._idle = self.loop.call_later(self.hub.limits.turn_idle_s, self._release_idle)

    def _release_idle(self) -> None:
        """No input for --realtime-turn-idle-s: the open prompt gives back its KV pages. The turn
        goes on; its next append opens the request again, recomputed (from the prefix cache where
        its pages were not reused meanwhile)."""
        self._idle = None
        if self.run is None and self.pending.is_open:
            self.pending.cancel()
            self.metrics.idle_turns.inc()

    async def on_response_create(self, event: dict) -> None:
        if self.run is not None:
            raise ProtocolError(f"response {self.run.id} is still in progress: cancel it or wait for response.done",
                                code="conversation_already_has_active_response")
        gen = parse_response_params(event.get("response"), self.cfg.gen, self.voices)
        await self._check_generation(gen, "response")
        await self._respond(gen)

    # ---- checks before work -------------------------------------------------------------------
    def _check_text(self, text: str, param: str) -> None:
        """Refuse text that cannot fit the model's context before anything tokenizes it (the HTTP
        routes' pre-check: at most MAX_CHARS_PER_TOKEN characters per context token)."""
        context = self.model.max_model_len
        if context and len(text) > MAX_CHARS_PER_TOKEN * context:
            raise ProtocolError(f"{param} holds {len(text)} characters, more than can fit the model's context of "
                                f"{context} tokens (at most {MAX_CHARS_PER_TOKEN} characters per token)",
                                param=param, code="input_too_long")

    async def _check_generation(self, gen: Generation, param: str) -> None:
        """Everything a response would refuse in `gen`, refused now: session.update and
        response.create share this, so a session never holds settings its responses cannot use.
        Sizes in characters on the loop; the model's own option checks (sampling ranges, the Talker
        instruction in characters, then tokens) and the tokenizing of the instructions in a worker."""
        self._check_text(gen.instructions, f"{param}.instructions")
        tokenizes = bool(gen.talker_instruction) or (self.listens and not (
            self.layout.has_system(self.cfg.gen.instructions) and self.layout.has_system(gen.instructions)))
        try:
            if tokenizes:
                await self._work(self._prepare_generation, gen)
            else:  # nothing to tokenize: range checks only, without waiting for a worker
                self._prepare_generation(gen)
        except InputError as e:
            where = e.param if e.param in ("instructions", "voice") else f"omnivox.{e.param}" if e.param else None
            raise ProtocolError(str(e), param=f"{param}.{where}" if where else None,
                                code=e.code or "invalid_value") from None

    def _prepare_generation(self, gen: Generation) -> None:  # a worker thread when it tokenizes
        if self.listens:
            self.model.options(**engine_options(gen))
            # tokenized here, read from the layout's cache later: the session's, then this one (newest)
            self.layout.system(self.cfg.gen.instructions)
            self.layout.system(gen.instructions)
        else:
            self.model.options(seed=gen.seed, max_frames=gen.max_audio_frames, temperature=gen.temperature,
                               top_p=gen.top_p, top_k=gen.top_k, repetition_penalty=gen.repetition_penalty)

    async def on_response_cancel(self, event: dict) -> None:
        run = self.run
        if run is None or (event.get("response_id") not in (None, run.id)):
            raise ProtocolError("there is no response in progress to cancel", code="response_cancel_not_active")
        await run.cancel("client_cancelled")

    async def _respond(self, gen: Generation) -> None:
        speech_end, self.speech_end = self.speech_end, None
        if self.listens:
            handle = self.pending.close(self.items, gen)
            audio_tokens = sum(it.rows.shape[0] for it in self.items if isinstance(it, AudioItem))
        else:
            handle = await self._work(self._speech, self._text_to_speak(), gen)
            audio_tokens = 0
        item = ReplyItem(new_id("item"), status="in_progress", audio=gen.audio)
        self.items.append(item)
        run = ResponseRun(self, handle, gen, item, speech_end, audio_tokens)
        self.run = run
        await run.start()
        run.task = asyncio.ensure_future(self._drive(run))

    async def _drive(self, run: ResponseRun) -> None:
        try:
            await run.run()
        except Exception:  # the socket went away mid-send: the request is cancelled by run()
            pass
        finally:
            if self.run is run:
                self.run = None
            self._sync()  # a turn spoken during the response waits for it to end

    def _text_to_speak(self) -> str:
        texts = []
        for it in reversed(self.items):
            if it.role == "assistant":
                break
            if isinstance(it, TextItem) and it.role == "user" and it.text.strip():
                texts.append(it.text)
        if not texts:
            raise ProtocolError("nothing to say: add a user message with input_text first (this text-to-speech "
                                "model voices the user's text)", code="nothing_to_say")
        return "\n".join(reversed(texts))

    def _speech(self, text: str, gen: Generation):  # worker thread
        if not gen.audio:
            raise ProtocolError("a text-to-speech model answers in audio: output_modalities must be [\"audio\"]",
                                param="output_modalities")
        return self.model.speech(text, voice=gen.voice, seed=gen.seed, max_frames=gen.max_audio_frames,
                                 temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k,
                                 repetition_penalty=gen.repetition_penalty, loop=self.loop)

    async def unsupported(self, event: dict) -> None:
        raise ProtocolError(f"{event['type']} is not supported over WebSocket (WebRTC/SIP only)",
                            code="unsupported_event")


HANDLERS: dict[str, Callable[[RealtimeSession, dict], Awaitable[None]]] = {
    "session.update": RealtimeSession.on_session_update,
    "input_audio_buffer.commit": RealtimeSession.on_commit,
    "input_audio_buffer.clear": RealtimeSession.on_clear,
    "conversation.item.create": RealtimeSession.on_item_create,
    "conversation.item.truncate": RealtimeSession.on_item_truncate,
    "conversation.item.delete": RealtimeSession.on_item_delete,
    "conversation.item.retrieve": RealtimeSession.on_item_retrieve,
    "response.create": RealtimeSession.on_response_create,
    "response.cancel": RealtimeSession.on_response_cancel,
    "output_audio_buffer.clear": RealtimeSession.unsupported,
}


def _is_append(event: dict | Exception) -> bool:
    return isinstance(event, dict) and event["type"] == APPEND


def _event_id(arg) -> str | None:
    event = arg[0][0] if isinstance(arg, list) else arg
    event_id = event.get("event_id") if isinstance(event, dict) else None
    return event_id if isinstance(event_id, str) else None
