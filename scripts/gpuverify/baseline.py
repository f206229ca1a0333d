"""Phase hf_generate: transformers' `generate` on the twin (omnivox's weights), same workloads.

Text: the prompt omnivox's text request used (greedy, `max_new_tokens` as omnivox), tokens/s over
the whole call (prefill included; transformers does not stream here) and how many leading tokens
equal omnivox's greedy reply. Speech: one request of the speech workload; transformers returns the
waveform at the end, so its TTFA is the whole call and RTF = call time / audio seconds. A
stopping criterion ends generation at the phase's deadline (the figures then cover what ran).
"""
from __future__ import annotations

import time

import torch

from gpuverify.runner import Box, Skip, State


def hf_generate(box: Box, st: State) -> bool:
    if st.hf is None:
        raise Skip(st.hf_error or "no transformers twin: the build phase did not make one")
    from omnivox.models.qwen3_omni.bench import prompts

    w, r, hf = st.sizes.work, box.results, st.hf
    text_p = st.extra.get("text_prompt") or prompts(st.qwen.cfg, 1, w.text_prompt, seed=1)[0]
    _generate(hf, text_p, 2, box.deadline, st.device, audio=False)  # warm-up
    box.check("text")
    ids, wall = _generate(hf, text_p, w.text_tokens, box.deadline, st.device, audio=False)
    r["text"] = {"tokens": len(ids), "wall_s": round(wall, 3), "tokens_per_s_overall": round(len(ids) / wall, 1)}
    mine = st.extra.get("omnivox_text_ids")
    if mine:
        same = next((i for i, (a, b) in enumerate(zip(ids, mine)) if a != b), min(len(ids), len(mine)))
        r["text"]["greedy_prefix_equal_to_omnivox"] = f"{same}/{min(len(ids), len(mine))}"
    box.check("speech")
    speech_p = prompts(st.qwen.cfg, 1, w.speech_prompt, seed=3)[0]
    try:  # its own error: the text figures above stay
        wav, wall = _generate(hf, speech_p, w.speech_tokens, box.deadline, st.device, audio=True,
                              frames=w.speech_frames)
    except Exception as e:
        r["speech_1"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        return False
    secs = wav.numel() / 24000 if wav is not None else 0.0
    r["speech_1"] = {"wall_s": round(wall, 3), "audio_s": round(secs, 3), "ttfa_ms": round(1e3 * wall, 1),
                     "rtf": round(wall / secs, 4) if secs else None, "frames": round(secs / 0.08)}
    return secs > 0


def _generate(hf, prompt: list[int], tokens: int, deadline: float, device: str, audio: bool, frames: int = 0):
    """-> (generated ids, or the waveform [samples] when `audio`; seconds)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Deadline(StoppingCriteria):
        """Stop at `deadline`, but never before 3 new tokens: transformers' composite generate
        fails when the Thinker writes one token or the Talker no frame (spec pitfall 17)."""

        def __init__(self):
            self.start = None

        def __call__(self, input_ids, scores, **kwargs):
            self.start = input_ids.shape[1] if self.start is None else self.start
            stop = time.monotonic() > deadline and input_ids.shape[1] - self.start >= 2
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    x = torch.tensor([prompt], device=device)
    kw = dict(input_ids=x, attention_mask=torch.ones_like(x), thinker_max_new_tokens=tokens, thinker_do_sample=False)
    if audio:  # the Thinker's reply is short; the deadline applies to the Talker's frames
        kw.update(talker_do_sample=False, talker_max_new_tokens=frames + 1, speaker="Ethan",
                  talker_stopping_criteria=StoppingCriteriaList([Deadline()]))
    else:
        kw.update(return_audio=False, thinker_stopping_criteria=StoppingCriteriaList([Deadline()]))
    _sync(device)
    t0 = time.monotonic()
    with torch.no_grad():
        out = hf.generate(**kw)
    _sync(device)
    wall = time.monotonic() - t0
    seq, wav = out if isinstance(out, tuple) else (out, None)
    seq = getattr(seq, "sequences", seq)
    if audio:
        return (wav.reshape(-1) if wav is not None else None), wall
    return seq[0, len(prompt):].tolist(), wall


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
