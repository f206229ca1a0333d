"""A windowed AR stage frees the pages behind its window as sessions advance, and no answer changes.

The tiny Qwen3-Omni Thinker is given an attention window of 7 (its adapter's `window`), decodes
far past it, and is compared with the same windowed model run where nothing is freed: with freed
pages poisoned (NaN), equal ids mean no freed page is ever read. The freeing run also replays its
decode steps through the graph runner (`cuda_graphs="fake"`), whose table width the window bounds.
"""
import pytest

from omnivox import Omni
from omnivox.engine.config import EngineConfig
from omnivox.engine.events import Finished, TextDelta
from omnivox.engine.scheduler import ARScheduler, window_pages
from omnivox.models.qwen3_omni.stages.thinker import ThinkerAdapter
from qwen_tiny import chat

WINDOW, BS, BUDGET = 7, 4, 8  # a window across page edges; prompts prefill in chunks of 8
BOUND = window_pages(WINDOW, BUDGET, BS)  # 5 pages a session, whatever its length
PROMPTS = [chat([1300 + 7 * i + k for k in range(3 + 5 * i)]) for i in range(4)]  # 13 .. 28 tokens
LENGTHS = [40, 25, 33, 18]  # Thinker tokens each: well past the window


def _config(**kw) -> EngineConfig:
    return EngineConfig(scheduling="fifo", block_size=BS, token_budget=BUDGET, **kw)


def _thinker(omni):
    return omni.engine.stages.stages["thinker"]


def _run(omni, prompts=PROMPTS, lengths=LENGTHS) -> list[list[int]]:
    outs = omni.generate([dict(prompt_ids=p, greedy=True, max_tokens=n, return_audio=False, ignore_eos=True)
                          for p, n in zip(prompts, lengths)])
    return [o.text_ids for o in outs]


@pytest.fixture(scope="module")
def windowed(tiny_reference):
    """(model folder, the windowed ids where nothing is freed, each session alone)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ThinkerAdapter, "window", WINDOW)
        mp.setattr(ARScheduler, "slide", lambda self, seq: None)  # the window masks; nothing is freed
        o = Omni(model=tiny_reference[1], progress=False, engine_config=_config(cuda_graphs="off"))
        try:
            alone = [_run(o, [p], [n])[0] for p, n in zip(PROMPTS, LENGTHS)]
        finally:
            o.close()
    o = Omni(model=tiny_reference[1], progress=False, engine_config=_config(cuda_graphs="off"))
    try:
        unbounded = _run(o)
    finally:
        o.close()
    assert unbounded != alone  # the window changes the answer: it really masks
    return tiny_reference[1], alone


@pytest.fixture
def window_on(monkeypatch):
    monkeypatch.setattr(ThinkerAdapter, "window", WINDOW)
    held: dict[str, int] = {}
    schedule = ARScheduler.schedule

    def spy(self, *a, **k):  # the most pages each windowed session holds at once
        batch = schedule(self, *a, **k)
        for seq, _ in batch.items:
            if seq.window is not None:
                held[seq.rid] = max(held.get(seq.rid, 0), len(seq.block_table))
        return batch

    monkeypatch.setattr(ARScheduler, "schedule", spy)
    return held


def test_freeing_behind_the_window_changes_no_token(windowed, window_on):
    folder, alone = windowed
    o = Omni(model=folder, progress=False,
             engine_config=_config(poison_freed_pages=True, cuda_graphs="fake", graph_buckets=(1, 2, 4)))
    try:
        together = _run(o)
        stage = _thinker(o)
        replays, width = stage.graphs.replays, stage.graphs.width
        stats = o.engine.stats()
    finally:
        o.close()
    assert together == alone  # a batch of sessions of different lengths: each equals its own run
    assert replays > 0 and width == window_pages(WINDOW, 1, BS) == 3  # decode steps replayed, table 3 wide
    assert len(window_on) == len(PROMPTS) and max(window_on.values()) <= BOUND  # bounded while growing
    assert stats.kv_pages_free == stats.kv_pages_total


def test_preempted_sessions_recompute_exactly_and_abort_frees_everything(windowed, window_on):
    """6 pages of 4 tokens in the Thinker: four sessions of up to 5 pages each do not fit at once, so
    the newest are preempted and recomputed from their first token (sliding as they go); each still
    equals its own run. A session cancelled mid-way returns every page."""
    folder, alone = windowed
    tight = _config(kv_cache_mb=0.024, prefix_cache=False, poison_freed_pages=True, cuda_graphs="off")
    o = Omni(model=folder, progress=False, engine_config=tight)
    try:
        assert _thinker(o).alloc.num_blocks == 6
        got = _run(o)
        preemptions = o.engine.stats().preemptions
        handle = o.submit(prompt_ids=PROMPTS[0], greedy=True, max_tokens=500, return_audio=False, ignore_eos=True)
        deltas = 0
        for ev in handle:
            deltas += isinstance(ev, TextDelta)
            if deltas == 50:  # 63 tokens, far past the window: 16 pages of 4 without freeing
                handle.cancel()
            if isinstance(ev, Finished):
                assert ev.finish_reason == "abort"
                break
        stats = o.engine.stats()
    finally:
        o.close()
    assert preemptions > 0
    assert got == alone
    assert max(window_on.values()) <= BOUND
    assert stats.kv_pages_free == stats.kv_pages_total and stats.in_flight == 0


def test_speculative_decoding_is_refused_on_a_windowed_stage(tiny_reference, monkeypatch):
    """Drafters read a sequence's pages from position 0, which a windowed stage frees."""
    from omnivox.engine.config import SpeculativeConfig

    monkeypatch.setattr(ThinkerAdapter, "window", WINDOW)
    o = Omni(model=tiny_reference[1], progress=False,
             engine_config=_config(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=2)))
    try:
        with pytest.raises(ValueError, match=r"speculative decoding does not run on a stage with an attention "
                                             r"window \(thinker\)"):
            o.engine  # built at first use
    finally:
        o.close()
