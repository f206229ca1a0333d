"""A prompt that grows while the user speaks (realtime input): audio rows appended in pieces are
prefilled as they arrive, and the answer equals the same prompt submitted whole."""
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from omnivox import Omni
from omnivox.audio.io import load_audio
from omnivox.audio.mel import log_mel, num_audio_tokens
from omnivox.engine.config import EngineConfig
from omnivox.serving import ChatParams
from qwen_tiny import ASSISTANT, AUDIO_END, AUDIO_PAD, AUDIO_START, IM_END, IM_START, NL, chat

MEDIA = Path(__file__).parent.parent / "media"


@pytest.fixture(scope="module")
def omni(tiny_reference):
    o = Omni(model=tiny_reference[1], progress=False, engine_config=EngineConfig(block_size=4, token_budget=64))
    yield o
    o.close()


def test_streamed_audio_equals_the_whole_prompt(omni):
    wave = load_audio(MEDIA / "speech_16k.wav")
    feats = log_mel(wave)
    n = num_audio_tokens(feats.shape[-1])
    whole = chat([AUDIO_START, *[AUDIO_PAD] * n, AUDIO_END, 500])
    kw = dict(greedy=True, max_tokens=8, max_frames=10, speaker="ethan")
    want = omni.generate(prompt_ids=whole, audio=[wave], **kw)
    with torch.no_grad():
        rows = omni.model.thinker.audio_tower([feats.to(torch.float32)])  # [n, H]
    head = whole[:whole.index(AUDIO_START) + 1]
    handle, stream = omni.open_prompt(head, ChatParams(**kw))
    steps = omni.engine.stats().stages["thinker"].steps
    for a in range(0, n, 7):  # pieces of 7 audio rows, as an incremental encoder would give them
        stream.append([AUDIO_PAD] * len(rows[a:a + 7]), embeds=rows[a:a + 7])
    stream.close([AUDIO_END, 500, IM_END, NL, IM_START, ASSISTANT, NL])
    fin, audio = handle.collect()
    assert fin.text_ids == want.text_ids
    np.testing.assert_array_equal(fin.codes, want.codes)
    np.testing.assert_allclose(audio, want.audio, rtol=0, atol=3e-5)
    assert omni.engine.stats().stages["thinker"].steps > steps


def _wait_prefilled(omni, handle, n_tokens: int, timeout: float = 60.0) -> None:
    """Until the Thinker has computed the first `n_tokens` of the request's (streamed) prompt."""
    thinker, deadline = omni.engine.stages.stages["thinker"], time.monotonic() + timeout
    while (seq := thinker.seqs.get(handle.request_id)) is None or seq.num_computed < n_tokens:
        assert time.monotonic() < deadline, f"{n_tokens} prompt tokens not prefilled after {timeout:g} s"
        time.sleep(0.01)


def test_the_prefill_runs_before_the_turn_is_closed(omni):
    head = chat([1800, 1801])[:-3]
    handle, stream = omni.open_prompt(head, ChatParams(max_tokens=3, return_audio=False, greedy=True))
    stream.append([1802 + k for k in range(20)])
    _wait_prefilled(omni, handle, len(head) + 20)
    time.sleep(0.2)  # a window for a wrong answer to show (a slow machine can only hide one, never fail this)
    assert not list(_events_so_far(handle))  # prefilled, but nothing answered yet
    stream.close([IM_START, ASSISTANT, NL])
    fin, _ = handle.collect()
    assert len(fin.text_ids) == 3


def _events_so_far(handle):
    import queue
    while True:
        try:
            yield handle._sync.get_nowait()
        except queue.Empty:
            return


def test_an_open_prompt_waiting_for_the_user_is_no_work(omni):
    """While the turn is open and its rows are prefilled, the Talker waits for the Thinker's
    answer: the engine thread sleeps (it used to retry the Talker in a busy loop, taking the GIL
    from the server's event loop and audio workers for the whole turn)."""
    head = chat([1800, 1801])[:-3]
    handle, stream = omni.open_prompt(head, ChatParams(max_tokens=2, max_frames=2, speaker="ethan", greedy=True))
    stream.append([1802 + k for k in range(6)])
    _wait_prefilled(omni, handle, len(head) + 6)
    graph, calls = omni.engine.stages, []
    real_step = graph.step
    graph.step = lambda: calls.append(1) or real_step()
    try:
        time.sleep(0.3)  # the window steps are counted in: a busy loop makes hundreds, however slow the machine
        idle = len(calls)
        stream.close([IM_START, ASSISTANT, NL])
        fin, _ = handle.collect()
    finally:
        del graph.step
    assert idle <= 3, f"{idle} engine steps in 0.3 s with nothing to compute"
    assert len(fin.text_ids) == 2 and fin.codes.shape[0] > 0
