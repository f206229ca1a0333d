"""A realtime conversation goes on after a reply that holds media placeholder ids: the model's own
ids re-enter the conversation as it generated them (plain tokens), and only new user input is
checked. The Thinker never samples control ids (tests/models/test_suppressed_ids.py), so this test
lifts that suppression to stand for a model whose reply holds one anyway: the demo then samples any
id, and a reply may hold `<|image_pad|>`. It looks for a seed whose reply does (a bounded search,
deterministic: the same seed each run), then asks for a spoken answer to a text item, and for one
more once that reply leads the conversation."""
from __future__ import annotations

import asyncio

from realtime_helpers import MODEL, b64, live_server, of_type, pieces, speech_pcm

SEEDS = 40  # replies tried (64 near-uniform tokens over ~1.1k ids: ~11 % each hold an image or video id)
WIDE = {"temperature": 20.0, "top_k": 0, "top_p": 1.0}  # near-uniform sampling over the demo vocabulary


async def answer(conn) -> list:
    """Events up to the response's end, or to an error (a refused response.create has no response.done)."""
    got = []
    async def collect():
        async for ev in conn:
            got.append(ev)
            if ev.type in ("response.done", "error"):
                return
    await asyncio.wait_for(collect(), 120)
    return got


def connect(url: str):
    from openai import AsyncOpenAI
    return AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0).realtime.connect(model=MODEL)


def test_a_reply_with_media_placeholders_does_not_break_the_next_turn(omni, monkeypatch):
    monkeypatch.setattr(omni.engine.stages.stages["thinker"].adapter, "suppress", None)
    th = omni.cfg.thinker
    placeholders = {th.image_token_id, th.video_token_id}

    async def run(url, app):
        async with connect(url) as conn:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                               "audio": {"input": {"turn_detection": None}},
                                               "max_output_tokens": 64, "omnivox": WIDE})
            for p in pieces(speech_pcm(lead_ms=200, tail_ms=200)):
                await conn.input_audio_buffer.append(audio=b64(p))
            await conn.input_audio_buffer.commit()
            (session,) = app.state.realtime.sessions.values()
            for seed in range(SEEDS):
                await conn.response.create(response={"omnivox": {"seed": seed}})
                events = await answer(conn)
                assert not of_type(events, "error"), events[-1]
                done = of_type(events, "response.done")[0].response
                assert done.status in ("completed", "incomplete"), done.status_details
                reply = session.conversation.items[-1]
                if placeholders & set(reply.ids):
                    break
            else:
                raise AssertionError(f"no reply of {SEEDS} seeds held an image or video placeholder")
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "And then?"}]})
            await conn.response.create(response={"output_modalities": ["audio"], "max_output_tokens": 8,
                                                 "omnivox": {"seed": 0, "max_audio_frames": 10}})
            spoken = await answer(conn)
            # the reply leads the conversation once the items before it are gone (no instructions)
            for item in session.conversation.items[:session.conversation.items.index(reply)]:
                await conn.conversation.item.delete(item_id=item.id)
            await conn.response.create(response={"max_output_tokens": 4})
            return seed, spoken, await answer(conn)

    with live_server(omni) as (url, app):
        seed, spoken, leading = asyncio.run(run(url, app))
    for events in (spoken, leading):
        assert not of_type(events, "error"), events[-1]
        done = of_type(events, "response.done")[0].response
        assert done.status in ("completed", "incomplete"), (seed, done.status_details)
    assert of_type(spoken, "response.output_audio.delta")
