"""Phase duplex: Moshi's full-duplex frame step against its 80 ms frame.

The model: Moshi's released depths at narrow width (`sizes.moshi_narrow`: temporal 32 layers at
dim 512, depformer 6 layers at 256, dep_q 8 of n_q 16, context 3000, text card 32000, card 2048)
and Kyutai's released Mimi (--tiny: the moshi-demo configs), random weights written as a checkpoint
folder in Kyutai's layout (`write_demo_checkpoint`, in a temporary folder under DIR) and loaded the real way
(`MoshiServed`): the LM in bf16 on the GPU (fp32 on CPU), Mimi in fp32. Then, per B (1, 8, 32;
--tiny: 1, 3): B greedy sessions on one stage graph, each pushed a frame of noise before every
engine step (Mimi's encoder, the LM with the depformer, Mimi's decoder: one frame of every session),
ms per step as the median of the steps after a warm-up step (and after one
warm-up session of 4 frames for the whole phase), `within_80ms` and `headroom` (80 / ms).
The sessions start empty, so the LM attends over at most a few frames (not the 3000-frame window).
Beside it the KV facts under the phase's budget: pages one session holds (`session_pages`) and
`max_sessions`. ok: it ran; a step over 80 ms is a finding, not a failure.
"""
from __future__ import annotations

import gc
import statistics
import tempfile
from pathlib import Path

import torch

from gpuverify.runner import Box, State

FRAME_MS = 80.0


def duplex(box: Box, st: State) -> bool:
    from gpuverify.sizes import moshi_narrow
    from omnivox.engine.config import EngineConfig
    from omnivox.models.moshi.demo import write_demo_checkpoint
    from omnivox.models.moshi.served import MoshiServed
    from omnivox.models.moshi.step_timing import frame_step_seconds

    sz, r = st.sizes, box.results
    lm = sz.duplex_lm or moshi_narrow()
    dtype = "bfloat16" if st.device.startswith("cuda") else "float32"
    cfg = EngineConfig(max_running=max(sz.duplex_batches), kv_cache_mb=sz.duplex_kv_mb)
    with tempfile.TemporaryDirectory(prefix="duplex-", dir=st.out) as tmp:  # ~1.1 GB at narrow: not left in DIR
        folder = write_demo_checkpoint(Path(tmp), seed=5, lm=lm, mimi=sz.duplex_mimi)
        box.check("load")
        served = MoshiServed(folder, dtype=dtype, device=st.device, engine_config=cfg)
    r["model"] = {k: lm[k] for k in ("num_layers", "dim", "depformer_num_layers", "depformer_dim", "dep_q", "n_q",
                                     "context", "text_card", "card")}
    r["model"] |= {"lm_dtype": dtype, "mimi": "released" if sz.duplex_mimi is None else "demo",
                   "params": served.parameter_count()}
    r["kv"] = {"kv_cache_mb": sz.duplex_kv_mb, "session_pages": served.session_pages,
               "max_sessions": served.max_sessions, "line": served.kv_summary()}
    r["frames"], r["frame_ms"] = sz.duplex_frames, FRAME_MS
    g = torch.Generator().manual_seed(0)
    box.check("warm-up")  # one-time costs (kernels' first calls, the vocoder's first frames) out of the timed steps
    frame_step_seconds(served, 0.1 * torch.randn(1, 4, served.frame_size, generator=g))
    for b in sz.duplex_batches:
        box.check(f"B={b}")
        pcm = 0.1 * torch.randn(b, sz.duplex_frames, served.frame_size, generator=g)
        ms = 1000 * statistics.median(frame_step_seconds(served, pcm))
        r[f"B={b}"] = {"ms_per_step": round(ms, 3), "ms_per_session_frame": round(ms / b, 3),
                       "within_80ms": ms <= FRAME_MS, "headroom": round(FRAME_MS / ms, 2)}
        gc.collect()  # the step's graph and its KV pool
        if st.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return True
