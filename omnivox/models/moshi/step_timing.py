"""Timing one engine frame step of Moshi's stage graph (benchmarks/duplex_step.py and
gpu_verify's `duplex` phase): B sessions, each pushed one 1920-sample frame before the step, as
`open_duplex` feeds them; the step runs Mimi's encoder, the LM (with the depformer) and Mimi's
decoder for all of them."""
from __future__ import annotations

import time

import torch

from omnivox.engine.prompt import PromptStream
from omnivox.models.moshi.served import MoshiServed, SessionInput
from omnivox.models.moshi.stages.graph import served_graph
from omnivox.serving_duplex import DuplexParams


def frame_step_seconds(served: MoshiServed, pcm: torch.Tensor) -> list[float]:
    """Seconds of each engine step after the first (untimed: a warm-up), greedy. pcm: [B, frames,
    frame_size] on the CPU; a fresh stage graph (its own KV pool) holds the B sessions."""
    graph = served_graph(served, served.engine_config)
    opts = served._options(DuplexParams(greedy=True))
    cuda = next(served.lm.parameters()).device.type == "cuda"
    inputs = []
    for _ in range(pcm.shape[0]):
        req = graph.new_request(None, opts, stream=PromptStream())
        req.push = lambda ev: None
        graph.admit(req, gate=False)
        inputs.append(SessionInput(req, served.frame_size, served._options))
    times = []
    for t in range(pcm.shape[1]):
        for i, inp in enumerate(inputs):
            inp.push(pcm[i, t].numpy())
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        graph.step()
        if cuda:
            torch.cuda.synchronize()
        if t:
            times.append(time.perf_counter() - start)
    return times
