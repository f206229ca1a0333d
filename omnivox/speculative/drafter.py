"""The drafter protocol: what a speculative method does for the Thinker's stage, in two calls.

Each step, before scheduling, the Thinker's adapter gathers its decoding rows that may draft (one
pending input, room left, speculation not switched off for the request) into `DraftRow`s and
makes ONE `Drafter.propose` call for all of them; the proposals (a device tensor) are verified by
the step that follows: each drafted position is sampled with the noise step the plain path uses
there and accepted while equal, so the output never depends on the drafter. After the step, and
whenever a row's computed positions shrink otherwise (preemption) or its request leaves (finish,
abort), ONE `Drafter.settle` call crops each such row's draft state to what it kept.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

from omnivox.sampling.batched import SamplingTensors


@dataclass
class DraftRow:
    """One row that drafts this step: its known ids (`tokens`, prompt then output; the last one is
    the pending input, the block's anchor, at position `computed`), its pages (the target's block
    table: the positions [0, computed) of the target's KV, and of the draft's where it keeps one),
    and how many ids it may propose (`k` >= 1)."""

    rid: str
    tokens: Sequence[int]
    computed: int
    block_table: list[int]
    k: int

    @property
    def anchor(self) -> int:
        return self.tokens[-1]


@dataclass
class DraftSampling:
    """How the target will sample each drafted position, for a drafter that draws its proposals the
    same way (coupled drafting): row r's j-th proposal is drawn with `tensors` row r * K + j (the
    noise step the target's draw at that position uses), `seen` [R, V] the ids row r drew before
    its drafts (the repetition penalty: proposal j also counts proposals 0..j-1), `suppress` [V]
    the ids never drawn; `stream` the noise stream."""

    tensors: SamplingTensors  # [R * K]
    width: int  # K: proposal positions per row
    seen: torch.Tensor | None
    suppress: torch.Tensor | None
    stream: int


@dataclass
class Proposals:
    """One `propose` call's answer: `ids` [R, K] long on the drafter's device (row r's first
    `counts[r]` entries are its proposals, the rest -1), and `probs` [R, K] the probability the
    draft model's own distribution (its softmax, before any sampling rule) gave each proposed id,
    or None for a drafter without one (prompt lookup)."""

    ids: torch.Tensor
    counts: list[int]
    probs: torch.Tensor | None = None
    _host: list[list[int]] | None = None

    @classmethod
    def from_lists(cls, drafts: list[list[int]], device: torch.device | str) -> "Proposals":
        """Host-made proposals (one copy to the device; the host lists are kept, never read back)."""
        width = max((len(d) for d in drafts), default=0)
        ids = torch.tensor([d + [-1] * (width - len(d)) for d in drafts], dtype=torch.long).reshape(len(drafts), width)
        return cls(ids.to(device), [len(d) for d in drafts], None, drafts)

    def host(self) -> list[list[int]]:
        """Each row's proposals as ids (for a device-made proposal: one read of the device)."""
        if self._host is None:
            flat = self.ids.cpu().tolist()
            self._host = [row[:n] for row, n in zip(flat, self.counts)]
        return self._host


class Drafter(ABC):
    """A speculative method. `method` names it in metrics ("ngram", "dflash")."""

    method: str = ""
    taps: tuple[int, ...] = ()  # target layers whose outputs `absorb` reads (none: it is never called)

    def wants_sampling(self) -> bool:
        """Does `propose` draw with the target's sampling (it needs `DraftSampling`)?"""
        return False

    @abstractmethod
    def propose(self, rows: list[DraftRow], sampling: DraftSampling | None) -> Proposals:
        """Up to `rows[r].k` ids guessed to follow each row's anchor, for every row at once (one
        batched call; a drafter may propose fewer, or none, for a row)."""

    def absorb(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Inside the target's step, for every token it computes (prefill chunks, decode and
        drafted positions alike; padding rows too, at the dummy slot): `features` [N, len(taps) *
        H] the outputs of layers `taps` (after the DeepStack addition), `positions` [N] long each
        token's index in its sequence, `slots` [N] the target's KV slots of those tokens. Device
        only: no host read, fixed shapes (a CUDA graph may replay it). A drafted position that is
        rejected is written too; the target's next step at that position writes over it."""

    def settle(self, kept: dict[str, int]) -> None:
        """Crop each named row's draft state to its first `kept[rid]` positions (what the target
        computed and accepted); 0 frees it (preemption, abort, finish). Default: no state."""

    def bind_pages(self, num_blocks: int, block_size: int) -> None:
        """The target's KV pages are known (`num_blocks` of `block_size` tokens): a drafter that
        keeps KV per position allocates it for those page ids here. Default: none."""

    def kv_bytes(self) -> int:
        """Bytes of draft KV cache this drafter holds (0: none)."""
        return 0
