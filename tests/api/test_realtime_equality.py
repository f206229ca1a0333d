"""A realtime turn is the offline generation of the same conversation: the same samples through the
same causal front end and AuT window, answered by `Omni.generate`, give equal codes and pcm.

And the incremental encode of a turn (pcm in 20-100 ms pieces through the streaming resampler, the
causal log-mel and the windowed encoder) equals the one-shot encode of `turn_features` of its
samples with the same window: features bit-identical, rows exact in float64, within 1e-5 in float32.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from omnivox.api.realtime.audio_input import TurnAudio
from omnivox.audio.io import encode_pcm16
from omnivox.audio.input_stream import CausalLogMel, StreamResampler, turn_features
from omnivox.audio.mel import num_audio_tokens
from omnivox.models.qwen3_omni.audio_encoder import AudioEncoder
from omnivox.models.qwen3_omni.audio_stream import AudioStreamBatch, AudioWindow
from omnivox.models.qwen3_omni.types import AudioFeatures
from realtime_helpers import MODEL, b64, events_until, live_server, of_type, pieces, reply_audio, speech_pcm

GEN = {"max_output_tokens": 8, "omnivox": {"greedy": True, "max_audio_frames": 12}}


def conversation_ids(omni, turns: list[tuple[int, list[int] | None]]) -> list[int]:
    """The prompt of a conversation, written out independently of the server's renderer:
    (audio rows, the reply's ids or None for the turn being answered) per turn."""
    tok, th = omni.tokenizer, omni.cfg.thinker
    user, assistant, end = (tok.encode(s) for s in ("<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>\n"))
    ids: list[int] = []
    for rows, reply in turns:
        ids += user + [th.audio_start_token_id] + [th.audio_token_id] * rows + [th.audio_end_token_id] + end + assistant
        if reply is not None:
            ids += reply + [omni.cfg.im_end_token_id] + [end[-1]]
    return ids


async def spoken_turn(conn, pcm: np.ndarray, seed: int):
    for p in pieces(pcm, seed):
        await conn.input_audio_buffer.append(audio=b64(p))
    return await events_until(conn, "response.done")


def test_realtime_turn_equals_omni_generate(omni):
    """Server VAD on the committed speech + silence appended in 20-100 ms pieces; the answer's codes
    and pcm equal Omni.generate on the turn's samples (speech_started .. speech_stopped) through the
    same front end and window, greedy."""
    pcm = speech_pcm()

    async def session(url, hub):
        from openai import AsyncOpenAI
        client = AsyncOpenAI(base_url=url + "/v1", api_key="none")
        async with client.realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={"type": "realtime", **GEN})
            created = await events_until(conn, "session.updated")
            events = await spoken_turn(conn, pcm, seed=1)
            (live,) = hub.sessions.values()
            return created, events, live.conversation.items[-1]

    with live_server(omni) as (url, app):
        hub = app.state.realtime
        created, events, reply = asyncio.run(session(url, hub))
        window = created[-1].session.model_extra["omnivox"]["audio_window_chunks"]
        assert window == hub.audio_window(1.0).window_chunks == 1
    start = of_type(events, "input_audio_buffer.speech_started")[0].audio_start_ms
    stop = of_type(events, "input_audio_buffer.speech_stopped")[0].audio_end_ms
    done = of_type(events, "response.done")[0].response
    assert done.status in ("completed", "incomplete")
    feats, _ = turn_features(pcm[start * 24:stop * 24])
    rows = num_audio_tokens(feats.shape[1])
    want = omni.generate(prompt_ids=conversation_ids(omni, [(rows, None)]), audio=[AudioFeatures(feats, window)],
                         greedy=True, max_tokens=8, max_frames=12)
    got = reply_audio(events)
    ref = np.frombuffer(encode_pcm16(want.audio), dtype="<i2").astype(np.int32)
    assert done.usage.input_token_details.audio_tokens == rows
    assert done.usage.output_token_details.audio_tokens == want.codes.shape[0] > 0
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 1
    np.testing.assert_array_equal(reply.codes, want.codes)
    assert reply.ids == want.text_ids


@pytest.mark.parametrize("dtype,exact", [(torch.float64, True), (torch.float32, False)])
def test_incremental_encode_equals_one_shot(omni, dtype, exact):
    """A turn's pcm in 20-100 ms pieces through TurnAudio (host pieces), encoded piece by piece as
    the encoder stage does (`AudioStreamBatch`) == turn_features + the one-shot encoder; each
    piece's rows are the number TurnAudio predicted."""
    enc = AudioEncoder(omni.model.thinker.audio_tower.cfg).eval()
    enc.load_state_dict({k: v.to(dtype) for k, v in omni.model.thinker.audio_tower.state_dict().items()})
    enc = enc.to(dtype)
    pcm = speech_pcm(lead_ms=300, tail_ms=500, clip="speech_long_16k.wav")  # > 8 s: several windows of every size
    batch = AudioStreamBatch(enc)
    for window in (1, 3, 8):
        turn = TurnAudio(AudioWindow(window, 2 * enc.cfg.n_window), 0, peak=None)
        emitted = []
        for p in pieces(pcm, seed=window):
            turn.push(p)
            emitted.append(turn.n_rows)
        turn.finish()
        feats, peak = turn_features(pcm)
        assert turn.peak == peak
        resampler, mel = StreamResampler(24000, 16000), CausalLogMel()
        pieced = [mel.push(resampler.push(p)) for p in pieces(pcm, seed=window)]
        pieced += [mel.push(resampler.flush()), mel.flush()]
        assert torch.equal(torch.cat(pieced, dim=1), feats)  # the front end: bit-identical in any pieces
        with torch.no_grad():
            one_shot = enc([feats.to(dtype)], window_chunks=window)
        state = batch.new_state(window)
        encoded = [batch.encode([(state, p.frames, p.final)])[0] for p, _ in turn.pieces]
        assert [r.shape[0] for r in encoded] == [n for _, n in turn.pieces]
        rows = torch.cat(encoded)
        assert rows.shape == one_shot.shape == (num_audio_tokens(feats.shape[1]), one_shot.shape[1])
        assert 0 < emitted[-1] < rows.shape[0]  # rows came out while the turn was still being pushed
        if exact:
            torch.testing.assert_close(rows, one_shot, atol=1e-12, rtol=0)
        else:
            torch.testing.assert_close(rows, one_shot, atol=1e-5, rtol=0)
