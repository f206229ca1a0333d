"""Realtime voice conversations: the OpenAI Realtime protocol over WebSocket (`/v1/realtime`),
server-side turn detection, incremental audio input, barge-in, full-duplex sessions, and the
browser playground.

  hub.py           the upgrade's checks (key, Origin, model, capacity), the session registry, the reader loop
  host.py          what the hub gives a session: the limits (RealtimeLimits), the shared parts (SessionHost)
  session.py       one session, what every kind shares (the kinds' hooks), and what the turn-based kinds share
  dispatch.py      client events in order, each handed to the part it is about
  outbox.py        server events in the session's dialect; a failed client event as an `error` event
  listening.py     the kind for models that listen: input audio, turns, the open prompt, barge-in
  speaking.py      the kind for text-to-speech models: text items in, speech out
  duplex.py        the kind for full-duplex models (Moshi): one open-ended response, appends pushed as they come
  protocol.py      GA and beta event names, the session configuration, error events
  audio_input.py   appended pcm -> turn detection -> causal front end -> windowed AuT rows (worker thread)
  conversation.py  items as ids and audio rows; rendering to a streamed prompt; truncation; conversation.item.*
  pending.py       the next response's engine request, prefilled while the user speaks
  response.py      one response's engine events as protocol events; response.create/cancel, one at a time
  metrics.py       realtime families of /metrics
See docs/realtime.md.
"""
from omnivox.api.realtime.host import RealtimeLimits
from omnivox.api.realtime.hub import RealtimeHub, mount_realtime

__all__ = ["RealtimeHub", "RealtimeLimits", "mount_realtime"]
