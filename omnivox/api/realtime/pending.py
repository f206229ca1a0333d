"""The next response's engine request, opened while the user is still speaking.

Its prompt is the conversation so far (`conversation.render`) followed by the open turn: the user
header, then the turn's host audio pieces as the front end makes them, each with the audio ids and
row keys of the rows it will make final. The request's route starts at the encoder stage: at the
next engine step it encodes the piece and the Thinker prefills the rows, so when the turn ends
only its tail is left to compute; `close` appends the assistant header and the model answers.
Nothing here waits on the engine.

The open request must always hold exactly what the next response would read. When the
conversation changes behind what it already holds (an item truncated, deleted or inserted before
the open turn, other instructions or options), it is cancelled and opened again: its earlier
pieces come back from the prefix cache, since they are the same ids and rows with the same keys
(the encoder stage reads back the rows it already computed: `engine.prompt.HostRows`).

KV budget: `sync` takes the room the request may hold, in Thinker pages (the session's share of
--realtime-turn-kv-share); what would grow it past the room is refused before anything is sent
(`TurnOverBudget`), and the session cancels the request: the turn is then computed when its
response starts, like a turn spoken with no request open.
"""
from __future__ import annotations

import asyncio

from omnivox.api.realtime.audio_input import TurnAudio
from omnivox.api.realtime.conversation import AudioItem, Item, audio_segments, render
from omnivox.api.realtime.protocol import Generation, ProtocolError
from omnivox.engine.handle import RequestHandle
from omnivox.engine.prompt import PromptStream, Segment
from omnivox.serving import ChatModel, ConversationLayout


class TurnOverBudget(ProtocolError):
    def __init__(self, pages: int, room: int):
        super().__init__(f"open turns hold the most KV cache they may (--realtime-turn-kv-share): this turn would "
                         f"hold {pages} pages where {room} are left; it is computed when its response starts",
                         code="turn_kv_budget")


class OpenPrompt:
    """At most one open request per session (not thread-safe: the session's event loop only)."""

    def __init__(self, model: ChatModel, layout: ConversationLayout, session_id: str,
                 loop: asyncio.AbstractEventLoop):
        self.model, self.layout, self.session_id, self.loop = model, layout, session_id, loop
        self.block_size = model.engine_config.block_size
        self.handle: RequestHandle | None = None
        self.stream: PromptStream | None = None
        self._reset()

    @property
    def pages(self) -> int:
        """KV pages the open request holds once its prompt so far is computed (0 when none is open)."""
        return -(-self.tokens // self.block_size)

    def _reset(self) -> None:
        self.tokens = 0  # prompt tokens sent to the open request
        self.consumed: list[tuple[str, int]] = []  # (item id, version) in the prompt, in order
        self.gen: Generation | None = None
        self.turn: TurnAudio | None = None  # the open turn whose pieces are being streamed
        self.turn_id: str | None = None
        self.pieces_sent = 0  # of turn.pieces
        self.rows_sent = 0
        self.held: list[Segment] = []  # a committed turn's end, appended with whatever comes next

    @property
    def is_open(self) -> bool:
        return self.handle is not None

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.handle = self.stream = None
        self._reset()

    def sync(self, items: list[Item], gen: Generation, turn: TurnAudio | None = None, turn_id: str | None = None,
             room: int | None = None) -> None:
        """Make the open request hold exactly the conversation + the open turn's rows so far, within
        `room` KV pages (None: no bound; raises TurnOverBudget before sending anything)."""
        want = [(it.id, it.version) for it in items]
        if self.handle is not None:
            behind = want[:len(self.consumed)] != self.consumed
            after_turn = self.turn_id is not None and (turn_id != self.turn_id or want != self.consumed)
            if behind or after_turn or gen != self.gen:
                self.cancel()
        if self.handle is None:
            self._open(items, gen, turn, turn_id, room=room)
            return
        segs = self.held + [seg for it in items[len(self.consumed):] for seg in it.segments(self.layout, self.session_id)]
        opens_turn = turn is not None and self.turn_id is None
        if opens_turn:
            segs.append(Segment(self.layout.audio_open()))
        rows = self._new_rows(turn, turn_id) if turn is not None else []
        self._check(room, segs + rows)
        self.held = []
        self._send(segs)
        self.consumed = want
        if opens_turn:
            self.turn, self.turn_id = turn, turn_id
        self._send_rows(rows)

    def commit(self, item: AudioItem) -> None:
        """The open turn became `item`. Its last rows (the flushed window) and the end of the user
        turn are held until what follows (most often the assistant header, right away): appended
        together, one engine step computes them and answers, instead of a step for the rows and
        another for the header."""
        if self.handle is None or self.turn_id != item.id:
            return
        self.held = self._new_rows(self.turn, self.turn_id) + [Segment(self.layout.audio_close())]
        self.consumed.append((item.id, item.version))
        self.turn = self.turn_id = None
        self.pieces_sent = self.rows_sent = 0

    def close(self, items: list[Item], gen: Generation) -> RequestHandle:
        """End the prompt with the assistant header: the request answers. Returns its handle."""
        header = self.layout.reply_header()
        if self.handle is not None and self.turn_id is None:
            self.sync(items, gen)
        if self.handle is None or self.turn_id is not None:
            self.cancel()
            self._open(items, gen, None, None, tail=[Segment(header)])
            self.stream.close()
        else:
            self._append_held()
            self.stream.close(header)
        handle = self.handle
        self.handle = self.stream = None
        self._reset()
        return handle

    # ---- internals ----------------------------------------------------------------------------
    def _open(self, items: list[Item], gen: Generation, turn: TurnAudio | None, turn_id: str | None,
              tail: list[Segment] = (), room: int | None = None) -> None:
        segs = render(items, self.layout, self.session_id, gen.instructions)
        if turn is not None:
            segs.append(Segment(self.layout.audio_open()))
        segs += list(tail)
        if not segs:
            return  # nothing to hold yet (an empty conversation before the first turn)
        rows = self._new_rows(turn, turn_id) if turn is not None else []
        self._check(room, segs + rows)
        first, rest = segs[0], segs[1:]
        self.handle, self.stream = self.model.open_prompt(first.ids, gen.chat_params(), segments=rest, loop=self.loop)
        self.tokens = sum(len(seg.ids) for seg in segs)
        self.consumed, self.gen = [(it.id, it.version) for it in items], gen
        if turn is not None:
            self.turn, self.turn_id = turn, turn_id
            self._send_rows(rows)

    def _check(self, room: int | None, segs: list[Segment]) -> None:
        pages = -(-(self.tokens + sum(len(seg.ids) for seg in segs)) // self.block_size)
        if room is not None and pages > room:
            raise TurnOverBudget(pages, room)

    def _new_rows(self, turn: TurnAudio, turn_id: str | None) -> list[Segment]:
        """The turn's pieces not sent yet, as segments (each keeps its row identities)."""
        return audio_segments(turn, self.layout, self.session_id, turn_id, self.pieces_sent)

    def _send_rows(self, rows: list[Segment]) -> None:
        self._send(rows)
        self.pieces_sent += len(rows)
        self.rows_sent += sum(len(seg.ids) for seg in rows)

    def _send(self, segs: list[Segment]) -> None:
        if segs:
            self.stream.extend(segs)
            self.tokens += sum(len(seg.ids) for seg in segs)

    def _append_held(self) -> None:
        held, self.held = self.held, []
        self._send(held)
