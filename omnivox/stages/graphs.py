"""CUDA graphs of a stage's decode step, one per batch-size bucket and inputs' host flags.

A decode step (every row computes one token and samples) of at most the largest bucket's rows is
padded to the smallest bucket that holds it: padding rows write to the KV pool's dummy slot,
attend to nothing real (seq_len 0), and sample or decode into scratch rows. For each bucket (and
each combination of the inputs' host flags, e.g. which sampling rules are on) the runner keeps
static input buffers, the step's metadata tensors and the outputs of one captured
`compute(inputs, ctx)`; a step copies its inputs into the buffers and replays. Inputs and
outputs are dataclasses of tensors and host values (nested dataclasses, lists and tuples too):
the runner clones, copies and keys graphs on their declared fields. Everything else
runs eagerly: prefill and mixed steps, batches above the largest bucket, graphs switched off.

`graph_factory` is the capture seam: `CudaGraph` on a GPU (largest bucket first, one memory pool);
CPU tests pass `FakeGraph`, which records the function and calls it again on the static buffers,
so every part of the plumbing but the capture itself runs in the suite.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch

from omnivox.attention.metadata import AttentionMetadata
from omnivox.engine.placement import CROSSING
from omnivox.tensors import map_tensors

Compute = Callable[[Any, Any], Any]  # (inputs dataclass, context) -> outputs dataclass


class CudaGraph:
    """torch.cuda.CUDAGraph behind the seam: warm-up runs on a side stream, then the capture."""

    def __init__(self, pool=None):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], Any]) -> Any:
        # A graph is captured lazily while serving when a step brings a new sampling-flag
        # signature (warm-up captures greedy rows only: the combinations of flags x buckets are
        # too many to capture up front). Only this stage's loop launches kernels on its device
        # but for the hand-overs of another loop (engine/placement.py), which wait for CROSSING;
        # "thread_local" keeps a capture from failing on an unrelated CUDA call of another thread.
        with CROSSING:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # kernels compile and allocators settle before the capture
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
                return fn()

    def replay(self) -> None:
        self.graph.replay()


class FakeGraph:
    """For CPU tests: `replay` calls the recorded function again and writes its results into the
    outputs of the capture, as a real replay refills the same buffers."""

    def __init__(self, pool=None):
        self.fn: Callable[[], Any] | None = None
        self.out: Any = None
        self.replays = 0

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        _copy(self.out, self.fn())
        self.replays += 1


@dataclasses.dataclass
class _Captured:
    graph: Any
    inputs: Any
    meta: AttentionMetadata | None
    outputs: Any


class GraphRunner:
    """`neutralize(inputs, meta)` points a copy of a step's inputs at scratch state (KV writes to
    the dummy slot, state-pool rows to the scratch row): the warm-up and capture runs execute on
    it, so capturing changes nothing a request owns; the real step then replays once."""

    def __init__(self, compute: Compute, make_ctx: Callable[[AttentionMetadata | None], Any], buckets: list[int],
                 width: int, graph_factory: Callable[..., Any] = CudaGraph,
                 neutralize: Callable[[Any, AttentionMetadata | None], None] = lambda inputs, meta: None):
        self.compute, self.make_ctx, self.neutralize = compute, make_ctx, neutralize
        self.buckets = sorted(set(buckets))
        self.width = width  # pages per row in a captured step's block table
        self.graph_factory = graph_factory
        self.pool = torch.cuda.graph_pool_handle() if graph_factory is CudaGraph else None
        self.graphs: dict[tuple, _Captured] = {}
        self.capture_seconds = 0.0
        self.replays = 0

    def bucket_for(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def bucket(self, rows: list, sampled: list[int]) -> int | None:
        """The bucket of a decode step (every row one token and sampled), else None (eager)."""
        if not rows or len(sampled) != len(rows) or any(r.n != 1 for r in rows):
            return None
        return self.bucket_for(len(rows))

    def run(self, bucket: int, inputs: Any, meta: AttentionMetadata | None) -> Any:
        key = (bucket, _signature(inputs))
        g = self.graphs.get(key)
        if g is None:
            g = self._capture(key, inputs, meta)
        _copy(g.inputs, inputs)
        if meta is not None:
            _copy_meta(g.meta, meta)
        g.graph.replay()
        self.replays += 1
        return g.outputs

    def _capture(self, key: tuple, inputs: Any, meta: AttentionMetadata | None) -> _Captured:
        start = time.perf_counter()  # wall time for the start-up report, not a decision
        static = _clone(inputs)
        static_meta = _clone_meta(meta) if meta is not None else None
        self.neutralize(static, static_meta)
        ctx = self.make_ctx(static_meta)

        def fn() -> Any:
            if static_meta is not None:
                static_meta.derived.clear()  # derived index tensors are part of the captured step
            return self.compute(static, ctx)

        graph = self.graph_factory(self.pool)
        outputs = graph.capture(fn)
        g = self.graphs[key] = _Captured(graph, static, static_meta, outputs)
        self.capture_seconds += time.perf_counter() - start
        return g


# ---- a step's inputs and outputs: dataclasses (nested: sampling tensors), lists, tuples, tensors, host values
def _signature(obj: Any) -> Any:
    """What a captured graph depends on: every tensor's shape and dtype, every host value."""
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape), obj.dtype, obj.device.type)
    if isinstance(obj, (list, tuple)):
        return tuple(_signature(v) for v in obj)
    if dataclasses.is_dataclass(obj):
        return (type(obj).__name__, tuple((f.name, _signature(getattr(obj, f.name))) for f in dataclasses.fields(obj)))
    return obj


def _clone(obj: Any) -> Any:
    return map_tensors(torch.Tensor.clone, obj)


def _copy(dst: Any, src: Any) -> None:
    """src's tensors into dst's (same structure and shapes: `_signature` matched)."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src):
            _copy(d, s)
    elif dataclasses.is_dataclass(dst):
        for f in dataclasses.fields(dst):
            _copy(getattr(dst, f.name), getattr(src, f.name))


_META_TENSORS = ("write_slots", "cu_q", "seq_lens", "block_table", "last_token_index")


def _clone_meta(meta: AttentionMetadata) -> AttentionMetadata:
    return dataclasses.replace(meta, derived={}, **{f: getattr(meta, f).clone() for f in _META_TENSORS})


def _copy_meta(dst: AttentionMetadata, src: AttentionMetadata) -> None:
    for f in _META_TENSORS:
        getattr(dst, f).copy_(getattr(src, f))
    dst.seq_lens_host = src.seq_lens_host


def make_runner(cfg, device: torch.device | str, compute: Compute, make_ctx, width: int,
                neutralize: Callable[[Any, AttentionMetadata | None], None]) -> GraphRunner | None:
    """The runner `EngineConfig.cuda_graphs` asks for: "auto" = CUDA graphs on a CUDA device,
    "off" (`--enforce-eager`), or "fake" (CPU tests of the plumbing)."""
    mode = cfg.cuda_graphs
    if mode == "off" or (mode == "auto" and torch.device(device).type != "cuda"):
        return None
    buckets = [b for b in cfg.graph_buckets if b <= cfg.max_running] or [cfg.max_running]
    return GraphRunner(compute, make_ctx, buckets, width, FakeGraph if mode == "fake" else CudaGraph, neutralize)
