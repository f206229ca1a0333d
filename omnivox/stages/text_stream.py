"""The text a chat stage generates, family-neutral: what one sampled token does to its request.

A chat family's AR stage (e.g. Qwen3-Omni's Thinker) keeps one `TextStream` per request and hands
it each token the request accepts, in order. `push(tok)`:
1. records the id (`req.text_ids`), detokenizes it incrementally and streams the text delta to the
   client (`req.text`, `req.emit_text`);
2. applies the stop rules: a stop id ("stop"), the request's token limit or the model's context
   ("length"); at the end the decoder's held-back rest is streamed too;
3. extends the voiced stream (`VoicedIds`) a speech stage reads, when the request speaks: the ids
   themselves, or what the request's text hook releases of the text, re-encoded, plus an end id;
4. returns True when the request's text is over (`req.text_done_time` is then set).
The stage owns the rest: its sequence (grown by each token that is not the last) and its state.
A hook that raises or returns a non-string raises `HookError`, which fails that request only."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from omnivox.engine.request import Request
from omnivox.errors import InputError

# A text hook gets each new text delta (and, once, final=True with the rest) and returns the text
# to voice now: the same, a rewrite, or "" / None to withhold it.
TextHook = Callable[[str, bool], "str | None"]


class HookError(InputError):
    """A request's text hook raised or returned garbage."""


class Detokenizer(Protocol):
    """An incremental decoder: the text each pushed id completes, then the rest held back."""

    def push(self, tok: int) -> str: ...

    def flush(self) -> str: ...


@dataclass(eq=False)
class VoicedIds:
    """The ids a speech stage voices, written by a `TextStream`; `final`: no more will come."""

    ids: list[int] = field(default_factory=list)
    final: bool = False


class TextStream:
    """One request's generated text: recording, streaming, stop rules and the voiced ids."""

    def __init__(self, req: Request, *, stops: set[int], max_tokens: int, context: int | None,
                 decoder: Detokenizer | None = None, voiced: VoicedIds | None = None, hook: TextHook | None = None,
                 end_id: int | None = None, encode: Callable[[str], list[int]] | None = None):
        """`context`: the model's length limit (None or 0: none); `voiced`: None when the request
        does not speak; with a `hook`, `encode` re-tokenizes what it releases and `end_id` ends it."""
        self.req, self.stops, self.max_tokens, self.context = req, stops, max_tokens, context
        self.decoder, self.voiced, self.hook, self.end_id, self.encode = decoder, voiced, hook, end_id, encode

    def push(self, tok: int) -> bool:
        """Record and stream one token; True when the request's text is over."""
        req = self.req
        req.text_ids.append(tok)
        delta = self.decoder.push(tok) if self.decoder is not None else ""
        req.text += delta
        req.emit_text(delta, [tok])
        total = req.prompt_tokens + len(req.text_ids)
        done = tok in self.stops or len(req.text_ids) >= self.max_tokens or bool(self.context and total >= self.context)
        if done:
            req.finish_reason = "stop" if tok in self.stops else "length"
            if req.finish_reason == "length":
                req.limit = req.limit or "tokens"
            rest = self.decoder.flush() if self.decoder is not None else ""
            if rest:
                req.text += rest
                req.emit_text(rest, [])
            delta += rest
        self._voice(tok, delta, done)
        if done:
            req.text_done_time = req.clock.now()
        return done

    def _voice(self, tok: int, delta: str, done: bool) -> None:
        """Extend the voiced stream: the ids, or what the hook releases (re-tokenized)."""
        v = self.voiced
        if v is None:
            return
        if self.hook is None:
            v.ids.append(tok)
        else:
            try:
                released = self.hook(delta, done) or ""
            except Exception as e:  # a broken hook fails its own request only
                raise HookError(f"text hook failed: {type(e).__name__}: {e}") from None
            if not isinstance(released, str):
                raise HookError(f"text hook must return a string or None, got {type(released).__name__}")
            if released:
                v.ids.extend(self.encode(released))
            if done:
                v.ids.append(self.end_id)  # the end marker (Qwen's Talker drops it for tts_eos)
        v.final = done
