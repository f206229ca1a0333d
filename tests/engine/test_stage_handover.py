"""Stages meet only at their declared hand-overs (engine/placement.py).

A placement puts each Qwen3-Omni stage (thinker, encoder, talker with its code predictor, vocoder)
on its own device: its weights, KV pool and state live there. A tensor may cross from one stage to
another only through `placement.hand_over` (the Talker's projections of the Thinker's word
embeddings and accept-layer rows, the encoders' features handed to the Thinker); everything else
crosses as host ints. An op that mixes two stages' tensors anywhere else is a cross-device error
once the stages are on different devices, or a silent extra copy if some `.to()` papers over it.

On one CPU this is checked by taint: a TorchDispatchMode tags each stage's parameters, buffers, KV
pool and state (per storage), every aten op's outputs (and mutated inputs) get the union of its
inputs' tags, and an op whose inputs carry two stages is a violation. `hand_over` is replaced by a
copy that carries no tag: the declared crossing. The stage graph is driven in this thread (a
dispatch mode is thread-local; the Engine steps in its own thread).
"""
from __future__ import annotations

import sys
import traceback
import weakref
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from omnivox import Omni
from omnivox.audio.io import load_audio
from omnivox.audio.mel import log_mel, num_audio_tokens
from omnivox.engine import placement
from omnivox.engine.config import EngineConfig
from omnivox.engine.events import AudioChunk, Finished
from omnivox.models.qwen3_omni.image_processor import num_vision_tokens, preprocess_image
from omnivox.models.qwen3_omni.stages.graph import build
from omnivox.models.qwen3_omni.talker_prompt import TalkerInputs
from omnivox.serving import ChatParams
from qwen_tiny import AUDIO_END, AUDIO_PAD, AUDIO_START, IMAGE_PAD, VISION_END, VISION_START, chat

MEDIA = Path(__file__).parent.parent / "media"
STAGES = ("thinker", "encoder", "talker", "vocoder")
KEEP = 40  # violations kept with their stack (a mixed output taints what follows: the first ones matter)


def _tensors(obj, depth: int = 0):
    """The tensors held in `obj` (lists, tuples, dicts, dataclass-like objects)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth + 1)
    elif depth < 4 and hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        for x in vars(obj).values():
            yield from _tensors(x, depth + 1)


class StageTaint(TorchDispatchMode):
    """Tags per storage (weakly keyed: a freed storage forgets its tags); see the module docstring."""

    def __init__(self):
        super().__init__()
        self.tags: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.ops: Counter = Counter()  # stage -> ops that read its tensors
        self.violations: list[tuple[str, tuple[str, ...], list[str]]] = []
        self.mixed = 0  # every mixing op, kept or not
        self.crossings: Counter = Counter()  # caller of hand_over -> calls

    def tag(self, t: torch.Tensor, stages) -> None:
        st = t.untyped_storage()
        self.tags[st] = self.tags.get(st, frozenset()) | frozenset(stages)

    def stages_of(self, tensors) -> frozenset:
        out: frozenset = frozenset()
        for t in tensors:
            try:
                out |= self.tags.get(t.untyped_storage(), frozenset())
            except (RuntimeError, NotImplementedError):  # no storage (sparse, ...)
                pass
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        stages = self.stages_of(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor))
        out = func(*args, **kwargs)
        if stages:
            self.ops.update(stages)
            if len(stages) > 1:
                self.mixed += 1
                if len(self.violations) < KEEP:
                    where = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                             if "/omnivox/" in f.filename or f.filename == __file__][-6:]
                    self.violations.append((str(func), tuple(sorted(stages)), where))
            written = [a for a in pytree.tree_leaves(out) if isinstance(a, torch.Tensor)]
            for i, arg in enumerate(func._schema.arguments):  # in-place / out= arguments
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
                    written += [a for a in pytree.tree_leaves(value) if isinstance(a, torch.Tensor)]
            for t in written:
                try:
                    self.tag(t, stages)
                except (RuntimeError, NotImplementedError):
                    pass
        return out

    def report(self) -> str:
        return f"{self.mixed} mixing ops; the first:\n" + "\n".join(
            f"  {op} mixes {'+'.join(st)}\n      " + "\n      ".join(where) for op, st, where in self.violations)


def _declare_hand_overs(monkeypatch, mode: StageTaint) -> None:
    """Every module's `hand_over` -> produce() copied into a storage with no tag (on one device
    `.to()` returns the producer's own tensor, so it is cloned)."""
    original = placement.hand_over

    def hand_over(produce, device, **where):
        caller = sys._getframe(1)
        while caller.f_code.co_name.startswith("<"):  # a comprehension or lambda: its function
            caller = caller.f_back
        mode.crossings[caller.f_code.co_name] += 1
        with placement.CROSSING:
            out = produce().to(device).clone()
        mode.tags.pop(out.untyped_storage(), None)
        return out

    for mod in list(sys.modules.values()):
        try:
            if getattr(mod, "hand_over", None) is original:
                monkeypatch.setattr(mod, "hand_over", hand_over)
        except Exception:  # a lazy module that refuses getattr
            continue


def _tag_graph(mode: StageTaint, omni: Omni, graph) -> None:
    for stage, modules in omni.model.stage_modules().items():
        for m in modules:
            for t in [*m.parameters(), *m.buffers()]:
                mode.tag(t, {stage})
    for name in ("thinker", "talker"):  # KV pools, suppress masks, the code predictor's cache
        st = graph.stages[name]
        for t in [st.pool.k, st.pool.v, *_tensors(st.adapter.suppress), *_tensors(getattr(st.adapter, "cp_cache", None))]:
            mode.tag(t, {name})
    for t in _tensors(graph.stages["vocoder"].pool.state):  # the vocoder's streaming states
        mode.tag(t, {"vocoder"})
    shared = [sorted(tags) for tags in mode.tags.values() if len(tags) > 1]
    assert mode.tags and not shared, f"storages owned by two stages: {shared[:5]}"


@pytest.fixture(scope="module")
def omni(tiny_reference):
    o = Omni(model=tiny_reference[1], progress=False, engine_config=EngineConfig(scheduling="fifo"))
    yield o
    o.close()


def _requests(omni: Omni) -> dict[str, tuple]:
    """rid -> (prompt, options): text only, spoken (sampled), audio-in, image-in, text to speech."""
    wave = load_audio(MEDIA / "speech_16k.wav")[:16000]
    n_audio = num_audio_tokens(log_mel(wave).shape[-1])
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    n_img = num_vision_tokens(preprocess_image(image, omni.processor.vision)[1], 2)
    greedy = omni.options(ChatParams(greedy=True, ignore_eos=True, max_tokens=4, max_frames=4))
    return {
        "text": (omni.build_prompt(prompt_ids=chat([1000, 1001, 1002])), replace(greedy, return_audio=False)),
        "spoken": (omni.build_prompt(prompt_ids=chat([1010, 1011, 1012, 1013])),
                   omni.options(ChatParams(seed=3, temperature=0.8, ignore_eos=True, max_tokens=5, max_frames=5))),
        "audio": (omni.build_prompt(prompt_ids=chat([AUDIO_START, *[AUDIO_PAD] * n_audio, AUDIO_END, 500]), audio=[wave]),
                  greedy),
        "image": (omni.build_prompt(prompt_ids=chat([VISION_START, *[IMAGE_PAD] * n_img, VISION_END, 501]), images=[image]),
                  greedy),
        "tts": (omni.build_prompt(prompt_ids=chat([1020, 1021, 1022])), replace(greedy, speech_ids=(1020, 1021, 1022))),
    }


def _run(omni: Omni, mode: StageTaint, requests: dict[str, tuple], cfg: EngineConfig | None = None) -> dict[str, list]:
    """All `requests` admitted together, the graph stepped in this thread under `mode` until done."""
    graph = build(omni.model, cfg or omni.engine_config, omni.tokenizer, omni.suppressed_ids)
    assert len(graph.loops) == 1  # one device: every stage steps in this thread
    _tag_graph(mode, omni, graph)
    events: dict[str, list] = {rid: [] for rid in requests}
    with mode:
        for rid, (prompt, opts) in requests.items():
            req = graph.new_request(prompt, opts, request_id=rid)
            req.push = events[rid].append
            graph.admit(req)
        for _ in range(300):
            if not graph.active:
                break
            for req in graph.step():
                req.finish()
    assert not graph.active, "the graph did not finish its requests"
    graph.close()
    mode.preemptions = sum(s.kv_stats().preemptions for s in graph.stages.values() if s.kv_stats() is not None)
    for rid, evs in events.items():
        assert evs and isinstance(evs[-1], Finished), (rid, evs[-1:])
    return events


def _check(mode: StageTaint, events: dict[str, list], stages=STAGES) -> None:
    assert mode.mixed == 0, mode.report()
    assert all(mode.ops[s] > 0 for s in stages), dict(mode.ops)  # the tags really flowed
    for rid, evs in events.items():
        audio = [e for e in evs if isinstance(e, AudioChunk)]
        assert bool(audio) == (rid != "text"), rid


def test_stages_meet_only_at_hand_overs(omni, monkeypatch):
    """Text, spoken, audio-in, image-in and text-to-speech requests, batched."""
    mode = StageTaint()
    _declare_hand_overs(monkeypatch, mode)
    events = _run(omni, mode, _requests(omni))
    _check(mode, events)
    assert set(mode.crossings) == {"project_text", "project_hidden", "encode_media"}, dict(mode.crossings)


def test_preempted_stages_meet_only_at_hand_overs(omni, monkeypatch):
    """A KV pool too small for both spoken replies' growth: sequences are preempted and recomputed."""
    mode = StageTaint()
    _declare_hand_overs(monkeypatch, mode)
    opts = omni.options(ChatParams(greedy=True, ignore_eos=True, max_tokens=6, max_frames=6))
    reqs = {f"r{i}": (omni.build_prompt(prompt_ids=chat([1100 + 9 * i + k for k in range(6 + 2 * i)])), opts)
            for i in range(3)}
    tight = EngineConfig(scheduling="fifo", kv_cache_mb=0.047, block_size=4, prefix_cache=False)
    events = _run(omni, mode, reqs, tight)
    assert mode.preemptions > 0
    _check(mode, events, ("thinker", "talker", "vocoder"))


def test_a_crossing_outside_hand_over_is_found(omni, monkeypatch):
    """The detector works: the Talker's text projection reading the Thinker's embedding rows
    directly (no hand_over) is reported as mixing thinker and talker."""
    mode = StageTaint()
    _declare_hand_overs(monkeypatch, mode)

    def project_text(self, ids):
        embed = self.model.thinker.model.embed_tokens
        return self.model.talker.text_projection(embed(torch.tensor(ids, device=self.source)))

    monkeypatch.setattr(TalkerInputs, "project_text", project_text)
    reqs = _requests(omni)
    _run(omni, mode, {"spoken": reqs["spoken"]})
    assert mode.mixed > 0
    op, stages, where = mode.violations[0]
    assert stages == ("talker", "thinker"), mode.report()
    assert any("project_text" in w for w in where), mode.report()
