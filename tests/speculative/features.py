"""Test helpers: a drafter that records the target features the Thinker hands it, and the same
features from transformers' Thinker."""
from __future__ import annotations

import numpy as np
import torch

from omnivox.speculative.drafter import Drafter, DraftRow, DraftSampling, Proposals


STREAM_ATOL = 3e-5  # streamed vs one-shot decode (tests/engine/test_engine.py)


def same_outputs(got, want) -> None:
    """Speculation on equals off: text ids and codes exactly, audio within streaming's tolerance."""
    for g, w in zip(got, want, strict=True):
        assert g.text_ids == w.text_ids
        np.testing.assert_array_equal(g.codes, w.codes)
        if w.audio is not None and w.audio.size:
            np.testing.assert_allclose(g.audio, w.audio, rtol=0, atol=STREAM_ATOL)


class RecordingDrafter(Drafter):
    """Keeps every `absorb` call's (features, positions, slots) on the host; proposes nothing."""

    method = "record"

    def __init__(self, taps: tuple[int, ...]):
        self.taps = taps
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def absorb(self, features, positions, slots) -> None:
        self.calls.append((features.detach().cpu().clone(), positions.cpu().clone(), slots.cpu().clone()))

    def propose(self, rows: list[DraftRow], sampling: DraftSampling | None) -> Proposals:
        return Proposals.from_lists([[] for _ in rows], "cpu")

    def by_position(self, length: int) -> torch.Tensor:
        """[length, F]: one request's features by sequence position (the latest write of each; the
        step's padding rows excluded)."""
        out = torch.full((length, self.calls[0][0].shape[1]), float("nan"))
        for feats, pos, slots in self.calls:
            for f, p in zip(feats, pos.tolist()):
                if p < length:
                    out[p] = f
        return out


def attach(omni, taps: tuple[int, ...]) -> RecordingDrafter:
    """Swap a recording drafter into the Omni engine's Thinker (it then taps `taps` every step)."""
    rec = RecordingDrafter(taps)
    adapter = omni.engine.stages.stages["thinker"].adapter
    adapter.drafter, adapter.taps = rec, taps
    return rec


def text_model(ref):
    """transformers' Thinker text decoder inside a Qwen3-Omni model."""
    return next(m for m in ref.thinker.modules() if type(m).__name__ == "Qwen3OmniMoeThinkerTextModel")


@torch.no_grad()
def reference_features(ref, ids: list[int], taps: tuple[int, ...], **media) -> tuple[torch.Tensor, list]:
    """(the raw outputs of layers `taps` AFTER the DeepStack addition, concatenated [S, F];
    transformers' `output_hidden_states` list) for one prompt through transformers' Thinker."""
    text = text_model(ref)
    outs: dict[int, torch.Tensor] = {}
    hooks = [text.layers[i].register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o)) for i in taps]
    inner = text._deepstack_process
    level = iter(range(len(text.layers)))

    def deepstack(h, mask, embeds):  # the rows after the addition replace the layer's output
        out = inner(h, mask, embeds)
        i = next(level)
        if i in taps:
            outs[i] = out
        return out

    text._deepstack_process = deepstack
    try:
        x = torch.tensor([ids])
        res = ref.thinker(input_ids=x, attention_mask=torch.ones_like(x), output_hidden_states=True, **media)
    finally:
        text._deepstack_process = inner
        for h in hooks:
            h.remove()
    return torch.cat([outs[i][0] for i in taps], dim=-1), res.hidden_states
