"""A Thinker text hook changes what the Talker voices and nothing else."""
import numpy as np
import pytest

from omnivox.engine.events import AudioChunk, Finished


@pytest.fixture(scope="module")
def demo(demo_omni):
    return demo_omni


def _run(omni, hook=None):
    msgs = [{"role": "user", "content": "Tell me a story about a cat."}]
    h = omni.submit(msgs, greedy=True, max_tokens=10, max_frames=40, text_hook=hook)
    transcript, fin = "", None
    for ev in h:
        if isinstance(ev, AudioChunk):
            transcript += ev.transcript
        elif isinstance(ev, Finished):
            fin = ev
    return fin, transcript


def test_rewriting_hook_changes_only_the_voice(demo):
    plain, _ = _run(demo)
    seen = []

    def rewrite(delta: str, final: bool):
        seen.append(delta)
        return "Hello there, friend." if final else None  # withhold everything, then voice a rewrite

    hooked, transcript = _run(demo, rewrite)
    assert hooked.text_ids == plain.text_ids and hooked.text == plain.text  # the Thinker is untouched
    assert "".join(seen) == plain.text  # the hook saw exactly the Thinker's text
    assert hooked.transcript == transcript
    assert transcript.strip() == "Hello there, friend."  # the audio's transcript is what was voiced
    assert not np.array_equal(hooked.codes, plain.codes)

    # the same rewrite released at once gives the same voice: the Talker waited for the hook
    def early(delta: str, final: bool, said=[]):
        if not said:
            said.append(1)
            return "Hello there, friend."
        return None

    again, _ = _run(demo, early)
    np.testing.assert_array_equal(again.codes, hooked.codes)


def test_identity_hook_voices_what_it_returns(demo):
    returned = []

    def identity(delta: str, final: bool):
        returned.append(delta)
        return delta

    fin, transcript = _run(demo, identity)
    assert "".join(returned) == fin.text
    # what was voiced, decoded back (random demo text may hold invalid UTF-8, shown as U+FFFD)
    assert transcript.replace("\ufffd", "") == fin.text.replace("\ufffd", "")


def test_transcript_holds_every_voiced_token(demo):
    fin, transcript = _run(demo)
    # without a hook the Talker voices the Thinker's ids, the final one replaced by tts_eos
    want = demo.tokenizer.decode(fin.text_ids[:-1])
    assert transcript.replace("\ufffd", "") == want.replace("\ufffd", "")


def test_a_raising_hook_fails_only_its_request(demo):
    from omnivox.engine.events import Failed

    def broken(delta, final):
        raise RuntimeError("boom")

    msgs = [{"role": "user", "content": "Hi"}]
    good = demo.submit(msgs, greedy=True, max_tokens=6, max_frames=10)
    bad = demo.submit(msgs, greedy=True, max_tokens=6, max_frames=10, text_hook=broken)
    bad_events = list(bad)
    assert isinstance(bad_events[-1], Failed) and "boom" in bad_events[-1].message
    assert bad_events[-1].status == 400
    good_events = list(good)
    assert isinstance(good_events[-1], Finished) and good_events[-1].finish_reason == "length"
    stats = demo.engine.stats()
    assert stats.kv_pages_free == stats.kv_pages_total


def test_failed_requests_leave_no_trace_in_flight(demo):
    def broken(delta, final):
        raise RuntimeError("boom")

    for _ in range(3):
        list(demo.submit([{"role": "user", "content": "Hi"}], max_tokens=4, max_frames=4, text_hook=broken))
    assert demo.engine.stats().in_flight == 0 and demo.engine.busy == 0
