"""The next response's engine request, opened while the user is still speaking.

Its prompt is the conversation so far (`conversation.render`) followed by the open turn: the user
header, then the turn's audio rows as the encoder releases them. The Thinker prefills each piece
at the next engine step, so when the turn ends only its tail is left to compute; `close` appends
the assistant header and the model answers.

The open request must always hold exactly what the next response would read. When the
conversation changes behind what it already holds (an item truncated, deleted or inserted before
the open turn, other instructions or options), it is cancelled and opened again: its earlier
pieces come back from the prefix cache, since they are the same ids and rows with the same keys.
"""
from __future__ import annotations

import asyncio

from omnivox.api.realtime.audio_input import TurnAudio
from omnivox.api.realtime.conversation import AudioItem, ChatLayout, Item, audio_head, audio_tail, render, row_keys
from omnivox.api.realtime.protocol import Generation
from omnivox.engine.handle import RequestHandle
from omnivox.models.qwen3_omni.types import PromptStream, Segment


def engine_options(g: Generation) -> dict:
    """`Omni.options` keywords of a response's generation settings."""
    return dict(speaker=g.voice, return_audio=g.audio, max_tokens=g.max_output_tokens, max_frames=g.max_audio_frames,
                greedy=g.greedy, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                repetition_penalty=g.repetition_penalty, seed=g.seed, talker_instruction=g.talker_instruction)


class OpenPrompt:
    """At most one open request per session (not thread-safe: the session's event loop only)."""

    def __init__(self, omni, layout: ChatLayout, session_id: str, loop: asyncio.AbstractEventLoop):
        self.omni, self.layout, self.session_id, self.loop = omni, layout, session_id, loop
        self.handle: RequestHandle | None = None
        self.stream: PromptStream | None = None
        self._reset()

    def _reset(self) -> None:
        self.consumed: list[tuple[str, int]] = []  # (item id, version) in the prompt, in order
        self.gen: Generation | None = None
        self.turn: TurnAudio | None = None  # the open turn whose rows are being streamed
        self.turn_id: str | None = None
        self.pieces_sent = 0  # of turn.rows
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

    def sync(self, items: list[Item], gen: Generation, turn: TurnAudio | None = None, turn_id: str | None = None) -> None:
        """Make the open request hold exactly the conversation + the open turn's rows so far."""
        want = [(it.id, it.version) for it in items]
        if self.handle is not None:
            behind = want[:len(self.consumed)] != self.consumed
            after_turn = self.turn_id is not None and (turn_id != self.turn_id or want != self.consumed)
            if behind or after_turn or gen != self.gen:
                self.cancel()
        if self.handle is None:
            self._open(items, gen, turn, turn_id)
            return
        self._append_held()
        for it in items[len(self.consumed):]:
            for seg in it.segments(self.layout, self.session_id):
                self.stream.append(seg.ids, embeds=seg.embeds, keys=seg.keys)
        self.consumed = want
        if turn is not None:
            if self.turn_id is None:
                self.stream.append(audio_head(self.layout))
                self.turn, self.turn_id = turn, turn_id
            self._send_rows()

    def commit(self, item: AudioItem) -> None:
        """The open turn became `item`. Its last rows (the flushed window) and the end of the user
        turn are held until what follows (most often the assistant header, right away): appended
        together, one engine step computes them and answers, instead of a step for the rows and
        another for the header."""
        if self.handle is None or self.turn_id != item.id:
            return
        self.held = self._rows() + [Segment(audio_tail(self.layout))]
        self.consumed.append((item.id, item.version))
        self.turn = self.turn_id = None
        self.pieces_sent = self.rows_sent = 0

    def close(self, items: list[Item], gen: Generation) -> RequestHandle:
        """End the prompt with the assistant header: the request answers. Returns its handle."""
        header = self.layout.header["assistant"]
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
              tail: list[Segment] = ()) -> None:
        segs = render(items, self.layout, self.session_id, gen.instructions)
        if turn is not None:
            segs.append(Segment(audio_head(self.layout)))
        segs += list(tail)
        if not segs:
            return  # nothing to hold yet (an empty conversation before the first turn)
        first, rest = segs[0], segs[1:]
        self.handle, self.stream = self.omni.open_prompt(first.ids, segments=rest, loop=self.loop,
                                                         **engine_options(gen))
        self.consumed, self.gen = [(it.id, it.version) for it in items], gen
        if turn is not None:
            self.turn, self.turn_id = turn, turn_id
            self._send_rows()

    def _rows(self) -> list[Segment]:
        """The open turn's rows not sent yet, as segments (each keeps its row identities)."""
        t, out = self.turn, []
        while self.pieces_sent < len(t.rows):
            rows = t.rows[self.pieces_sent]
            n = rows.shape[0]
            out.append(Segment([self.layout.audio_pad] * n, embeds=rows,
                               keys=row_keys(self.session_id, self.turn_id, self.rows_sent, n)))
            self.pieces_sent += 1
            self.rows_sent += n
        return out

    def _send_rows(self) -> None:
        for seg in self._rows():
            self.stream.append(seg.ids, embeds=seg.embeds, keys=seg.keys)

    def _append_held(self) -> None:
        held, self.held = self.held, []
        for seg in held:
            self.stream.append(seg.ids, embeds=seg.embeds, keys=seg.keys)
