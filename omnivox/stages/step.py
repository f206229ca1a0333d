"""The step half of a paged AR stage's adapter: one step's batch, and the contract of what a family
computes over it.

`PagedARStage` builds one `StepBatch` per step (the scheduled rows, which of them sample, the flat
index of each sampling row's last token as one device tensor, the padding, the attention
metadata) and drives the family's `ARStep` over it: `inputs` (host) -> `compute` (device only,
what a CUDA graph replays) -> `apply` (host: the step's one read of the device). Inputs and
outputs are each family's own dataclasses of tensors (and host flags), which the graph runner
copies field by field.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from omnivox.attention.backends import AttentionBackend
from omnivox.attention.metadata import AttentionMetadata
from omnivox.engine.request import Request
from omnivox.engine.scheduler import Seq
from omnivox.engine.stage import Failures
from omnivox.kv_cache.pool import KVPool


@dataclass
class Row:
    """One scheduled sequence of a step: tokens [start, start + n) are computed now; the last
    len(draft) of them are drafted ids (speculative decoding), verified by this step."""

    req: Request
    seq: Seq
    start: int
    n: int
    draft: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.n


@dataclass
class StepBatch:
    """One step of a paged stage: `rows`, which of them sample, and for a step a CUDA graph
    replays, its `bucket` (the graph's batch size: `pad` padding rows follow the real ones). The
    sampling rows' sampled tokens (`sample_counts`: its last token, then one per draft: the
    position after each draft is sampled too), then one token per padding row, are
    `meta.last_token_index` ([sum(sample_counts) + pad] long, on the device): `compute` picks
    their hidden states with `PagedContext.sampled`, in the order of `sampled`."""

    rows: list[Row]
    sampled: list[int]  # indices into `rows` of the rows that sample their next token
    meta: AttentionMetadata
    bucket: int | None = None  # None: the step runs eagerly, unpadded

    @property
    def pad(self) -> int:
        return self.bucket - len(self.rows) if self.bucket else 0

    @property
    def sampled_rows(self) -> list[Row]:
        return [self.rows[i] for i in self.sampled]

    @property
    def sample_counts(self) -> list[int]:
        return [1 + len(self.rows[i].draft) for i in self.sampled]


class PagedContext:
    """The `layers.attention.KVCache` of one step of a paged stage: every layer's `attend` writes
    this step's K/V into the pool and attends through the step's metadata with the chosen backend."""

    def __init__(self, pool: KVPool, meta: AttentionMetadata, backend: AttentionBackend):
        self.pool, self.meta, self.backend = pool, meta, backend

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, H, D], k/v [N, Hkv, D] (the step's flattened tokens) -> [N, H, D]."""
        return self.backend.forward(q, k, v, self.pool.k[layer], self.pool.v[layer], self.meta)

    def sampled(self, h: torch.Tensor) -> torch.Tensor:
        """[N, ...] per token -> [M, ...]: the sampling rows' last tokens, then the padding rows'."""
        return h.index_select(0, self.meta.last_token_index)

    def any_sampled(self) -> bool:
        """Does any row sample this step (a shape, not a device read)?"""
        return self.meta.last_token_index.numel() > 0


@dataclass
class StepResult:
    """What a step did to its rows: `accepted[i]` tokens row i took this step (for a sampling row
    whose draws were valid, 1 + the drafts its draws confirmed, at most 1 + len(draft); 0
    otherwise), the requests this stage is done with, and the failed ones."""

    accepted: list[int]
    finished: list[Request]
    failures: Failures

    @classmethod
    def none(cls, rows: int) -> "StepResult":
        return cls([0] * rows, [], [])


class ARStep(ABC):
    """What a family computes in one step of its paged AR stage, over the stage's `StepBatch`."""

    def samples(self, row: Row) -> bool:
        """Does a row whose known inputs are all computed after this step sample its next token?"""
        return True

    def draft(self, seqs: list[Seq]) -> list[list[int]]:
        """Speculative decoding, one call for the step's drafting sequences (each decoding: one
        pending input): the ids guessed to follow each one's pending input, which the next step
        computes with it; the step samples after each, and `apply` takes the samples while they
        confirm the drafts (default: no drafts)."""
        return [[] for _ in seqs]

    def settle(self, kept: dict[str, int]) -> None:
        """Speculative decoding: these sequences' computed positions changed otherwise than by
        growing (drafts verified and cropped, preemption: `kept[rid]` positions remain; a finished
        or aborted request: 0). Crop per-row draft state to match (default: none)."""

    @abstractmethod
    def inputs(self, batch: StepBatch) -> Any:
        """Host side: the step's inputs (the family's dataclass of device tensors and host flags),
        built in one pass for the batch's rows and padding rows."""

    @abstractmethod
    def compute(self, inputs: Any, ctx: PagedContext) -> Any:
        """Device only: the forward over every token of the step and the sampling of the sampling
        rows (their hidden states: `ctx.sampled(h)`). Reads nothing back and has fixed shapes for
        fixed input shapes, so a CUDA graph can replay it. Returns the family's outputs dataclass
        (None when no row samples)."""

    @abstractmethod
    def apply(self, batch: StepBatch, outputs: Any) -> StepResult:
        """Host side: the step's one device read (the sampled ids) and what they do: record and
        stream them, extend each sequence (`seq.num_tokens += 1` once the next input is known:
        until then it has nothing to compute) or end it. A row with drafts samples 1 + len(draft)
        ids: the first always counts, each next one only while the one before equals its draft.
        Runs before the stage advances the rows' computed counts by what they accepted."""

    def neutralize(self, inputs: Any) -> None:
        """Point the inputs' writes to per-request state at scratch rows (default: none)."""
