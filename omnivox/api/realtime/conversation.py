"""A realtime conversation as the model reads it: items kept as token ids (+ a user turn's host
audio and rows), rendered to the segments of a streamed prompt. Host arrays only: no tensor.

Why ids and rows, not text: the prefix cache keys whole sequences (prompt and generated ids, each
audio row by its identity), so a follow-up turn reuses the KV of every earlier turn only if its
prompt repeats them exactly: an assistant reply as the ids the model generated (never
re-tokenized text), a user turn as the same audio rows with the same keys. A user turn renders
as its rows kept on the host once the encoder stage has computed them all (`TurnAudio.rows`), or
else as the exact pieces of host audio it was spoken in (the encoder stage encodes them again,
and reads back the rows already computed: one computation per key).

The layout (how each item becomes ids) is the model's: `ChatModel.conversation_layout`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from omnivox.api.realtime.audio_input import PCM_RATE, TurnAudio  # every reply's audio is sent (and counted) at it
from omnivox.api.realtime.outbox import Outbox
from omnivox.api.realtime.protocol import Dialect, ProtocolError, new_id
from omnivox.engine.prompt import Segment
from omnivox.serving import ConversationLayout



# ---- items ---------------------------------------------------------------------------------------
@dataclass(eq=False)
class Item:
    """One conversation item. `version` changes whenever its rendering does (a truncation)."""
    id: str
    role: str  # "user" | "assistant" | "system"
    version: int = 0
    status: str = "completed"

    def segments(self, layout: ConversationLayout, session_id: str) -> list[Segment]:
        raise NotImplementedError

    def content(self, dialect) -> list[dict]:
        raise NotImplementedError

    def to_json(self, dialect) -> dict[str, Any]:
        return {"id": self.id, "object": "realtime.item", "type": "message", "status": self.status,
                "role": self.role, "content": self.content(dialect)}


@dataclass(eq=False)
class TextItem(Item):
    text: str = ""
    ids: list[int] | None = None  # the text's ids, tokenized once in a worker when the item is created

    def segments(self, layout: ConversationLayout, session_id: str) -> list[Segment]:
        return layout.text_turn(self.role, self.ids if self.ids is not None else layout.text_ids(self.text))

    def content(self, dialect) -> list[dict]:
        kind = "input_text" if self.role in ("user", "system") else dialect.output_text
        return [{"type": kind, "text": self.text}]


def row_keys(session_id: str, item_id: str, start: int, n: int) -> list[tuple]:
    """Prefix-cache identities of audio rows: the same turn's rows keep them in every later turn."""
    return [("realtime", session_id, item_id, r) for r in range(start, start + n)]


def audio_segments(turn: TurnAudio, layout: ConversationLayout, session_id: str, item_id: str,
                   first: int = 0) -> list[Segment]:
    """A turn's pieces from `first` on as segments: each piece's audio ids with their row keys and
    its host audio (the encoder stage makes the rows). NOTE: a worker may be adding pieces
    meanwhile (they only ever grow): these are the ones there now."""
    out = []
    for piece, n in turn.pieces[first:]:
        out.append(Segment([layout.audio_pad] * n, keys=row_keys(session_id, item_id, piece.start, n), audio=piece))
    return out


@dataclass(eq=False)
class AudioItem(Item):
    """A spoken user turn: its host audio and, once encoded, its rows on the host (`turn`), so
    later turns re-append the same rows under the same keys."""
    turn: TurnAudio | None = None
    audio_ms: int = 0

    @property
    def n_rows(self) -> int:
        return self.turn.n_rows

    def segments(self, layout: ConversationLayout, session_id: str) -> list[Segment]:
        t = self.turn
        t.settle()
        if t.complete:
            n = t.n_rows
            body = [Segment([layout.audio_pad] * n, embeds=t.rows.rows(0, n), keys=row_keys(session_id, self.id, 0, n))]
        else:
            body = audio_segments(t, layout, session_id, self.id)
        return [Segment(layout.audio_open()), *body, Segment(layout.audio_close())]

    def content(self, dialect) -> list[dict]:
        return [{"type": "input_audio", "transcript": None}]


@dataclass
class Chunk:
    """What a response had produced when one of its audio chunks ended."""
    frames: int  # codec frames, cumulative
    samples: int  # output samples at 24 kHz, cumulative
    chars: int  # transcript characters, cumulative


@dataclass(eq=False)
class ReplyItem(Item):
    """An assistant reply: the ids the model generated (ending in <|im_end|>), what it said, and
    where its audio chunks and text deltas ended (to map a played position back to ids)."""
    role: str = "assistant"
    ids: list[int] = field(default_factory=list)
    text: str = ""  # the Thinker's text
    transcript: str = ""  # what was voiced
    audio: bool = True
    chunks: list[Chunk] = field(default_factory=list)
    deltas: list[tuple[int, int]] = field(default_factory=list)  # (text chars, ids) after each delta
    codes: Any = None  # [frames, groups] once finished
    truncated_ms: int | None = None

    def segments(self, layout: ConversationLayout, session_id: str) -> list[Segment]:
        return layout.reply(self.ids)

    def content(self, dialect) -> list[dict]:
        if self.audio:
            return [{"type": dialect.output_audio, "transcript": self.transcript}]
        return [{"type": dialect.output_text, "text": self.text}]

    @property
    def audio_ms(self) -> int:
        return self.chunks[-1].samples * 1000 // PCM_RATE if self.chunks else 0

    def truncate(self, audio_end_ms: int) -> None:
        """Keep what was played: the audio chunks wholly within `audio_end_ms` (their frames: 80 ms
        each for Qwen3-Omni), the transcript those chunks voiced, and the generated ids whose text
        that transcript covers (the voiced ids are the Thinker's: its text and the transcript are
        the same decoding, so a transcript length is a text length)."""
        played = [c for c in self.chunks if c.samples <= audio_end_ms * PCM_RATE // 1000]
        chars = played[-1].chars if played else 0
        keep = 0
        for text_chars, n_ids in self.deltas:
            if text_chars > chars:
                break
            keep = n_ids
        self.ids = self.ids[:keep]
        self.transcript = self.transcript[:chars]
        self.text = self.text[:chars]
        self.truncated_ms = audio_end_ms
        self.status = "incomplete"
        self.version += 1


@dataclass(frozen=True)
class ItemSpec:
    """A client's `conversation.item.create` item, checked: text parts, or one user audio part."""
    id: str
    role: str
    text: str = ""
    audio: str | None = None  # base64 pcm16


def parse_item(spec: Any, taken: set[str]) -> ItemSpec:
    if not isinstance(spec, dict):
        raise ProtocolError("item must be an object", param="item")
    if spec.get("type", "message") != "message":
        raise ProtocolError(f"item.type {spec.get('type')!r:.40} is not supported (no tool calls): send messages",
                            param="item.type", code="unsupported_feature")
    role = spec.get("role")
    if role not in ("user", "assistant", "system"):
        raise ProtocolError("item.role must be user, assistant or system", param="item.role")
    item_id = spec.get("id") or new_id("item")
    if not isinstance(item_id, str) or len(item_id) > 64 or item_id in taken:
        raise ProtocolError(f"item.id {item_id!r:.80} is not a new id of at most 64 characters", param="item.id")
    parts = spec.get("content")
    if not isinstance(parts, list) or not parts or not all(isinstance(p, dict) for p in parts):
        raise ProtocolError("item.content must be a non-empty list of content parts", param="item.content")
    kinds = {p.get("type") if isinstance(p.get("type"), str) else None for p in parts}
    if kinds <= {"input_text", "text", "output_text"}:
        if not all(isinstance(p.get("text"), str) for p in parts):
            raise ProtocolError("item.content: every text part needs a string `text`", param="item.content")
        return ItemSpec(item_id, role, text="".join(p["text"] for p in parts))
    if kinds == {"input_audio"} and len(parts) == 1 and role == "user":
        return ItemSpec(item_id, role, audio=parts[0].get("audio"))
    raise ProtocolError("item.content: a message holds text parts, or (a user message) one input_audio part",
                        param="item.content", code="unsupported_feature")


def render(items: list[Item], layout: ConversationLayout, session_id: str, instructions: str) -> list[Segment]:
    segs = layout.system(instructions)
    for it in items:
        segs += it.segments(layout, session_id)
    return segs


# ---- the session's conversation ------------------------------------------------------------------
class ConversationOwner(Protocol):
    """What a conversation reads of its session (`session.RealtimeSession` is one)."""

    out: Outbox
    dialect: Dialect

    def check_text(self, text: str, param: str) -> None: ...
    async def text_ids(self, text: str) -> list[int] | None: ...
    async def audio_item(self, spec: ItemSpec) -> Item: ...
    def sync(self) -> None: ...


class Conversation:
    """A session's items, in order, and the client events that change them (conversation.item.*).
    After each change the session's kind keeps what the next response reads up to date (`sync`)."""

    def __init__(self, session: ConversationOwner):
        self.session = session
        self.items: list[Item] = []

    def previous_id(self, item: Item) -> str | None:
        i = self.items.index(item) if item in self.items else len(self.items)
        return self.items[i - 1].id if i > 0 else None

    async def added(self, item: Item) -> None:
        """Tell the client `item` joined the conversation."""
        out, prev, dialect = self.session.out, self.previous_id(item), self.session.dialect
        await out.send({"type": "conversation.item.added", "previous_item_id": prev, "item": item.to_json(dialect)})
        await out.send({"type": "conversation.item.done", "previous_item_id": prev, "item": item.to_json(dialect)})

    def find(self, item_id: Any, param: str = "item_id") -> Item:
        for it in self.items:
            if it.id == item_id:
                return it
        raise ProtocolError(f"no conversation item {item_id!r:.80}", param=param, code="item_not_found")

    async def on_create(self, event: dict) -> None:
        s = self.session
        spec = parse_item(event.get("item"), {it.id for it in self.items})
        if spec.audio is None:
            s.check_text(spec.text, "item.content")
            item: Item = TextItem(spec.id, spec.role, text=spec.text, ids=await s.text_ids(spec.text))
        else:
            item = await s.audio_item(spec)
        self._insert(item, event.get("previous_item_id"))
        await self.added(item)
        s.sync()

    def _insert(self, item: Item, previous: Any) -> None:
        if previous is None:
            self.items.append(item)
        elif previous == "root":
            self.items.insert(0, item)
        else:
            self.items.insert(self.items.index(self.find(previous, "previous_item_id")) + 1, item)

    async def on_truncate(self, event: dict) -> None:
        s = self.session
        item = self.find(event.get("item_id"))
        if not isinstance(item, ReplyItem) or not item.audio:
            raise ProtocolError("only an assistant reply with audio can be truncated", param="item_id",
                                code="invalid_item")
        end = event.get("audio_end_ms")
        if isinstance(end, bool) or not isinstance(end, int) or end < 0:
            raise ProtocolError("audio_end_ms must be a non-negative integer", param="audio_end_ms")
        if event.get("content_index", 0) != 0:
            raise ProtocolError("content_index must be 0", param="content_index")
        run = s.responses.run
        if run is not None and run.item is item:  # still speaking: what comes next is unheard
            await run.cancel("client_cancelled")
        if end > item.audio_ms:
            raise ProtocolError(f"audio_end_ms {end} is past the end of the item's audio ({item.audio_ms} ms)",
                                param="audio_end_ms")
        item.truncate(end)
        await s.out.send({"type": "conversation.item.truncated", "item_id": item.id, "content_index": 0,
                          "audio_end_ms": end})
        s.sync()

    async def on_delete(self, event: dict) -> None:
        s = self.session
        item = self.find(event.get("item_id"))
        run = s.responses.run
        if run is not None and run.item is item:
            raise ProtocolError("the reply of the active response cannot be deleted; cancel the response first",
                                param="item_id")
        self.items.remove(item)
        await s.out.send({"type": "conversation.item.deleted", "item_id": item.id})
        s.sync()

    async def on_retrieve(self, event: dict) -> None:
        item = self.find(event.get("item_id"))
        await self.session.out.send({"type": "conversation.item.retrieved", "item": item.to_json(self.session.dialect)})
