"""One batched sampler for every Qwen3-Omni stage: per-row parameters as tensors, counter noise.

Per row, the rules and their order are those of transformers (the HF order):
repetition penalty over the ids in `seen` -> suppressed ids to -inf -> greedy rows: argmax ->
sampled rows: / temperature -> top-k -> top-p (HF rule) -> Gumbel-max draw, an exact categorical
draw whose noise is `noise.gumbel(seed, stream, step)`.

Device contract (every function below that takes tensors): no host reads (`.item()`, `nonzero`,
bool-mask indexing, multinomial, generators) and an aten op count that depends only on the host
flags of `SamplingTensors`, never on the batch size, so a call can be captured in a CUDA graph.
A row whose logits are unusable (NaN or +inf after processing, or all -inf) returns id -1 and
leaves the other rows untouched; nothing raises on bad values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from omnivox.errors import InputError
from omnivox.sampling import noise
from omnivox.sampling.params import SamplingParams

FAILED = -1  # the id returned for a row with unusable logits


class SamplingError(InputError):
    """A request's logits gave no valid distribution (NaN or inf): only that request fails."""


@dataclass
class SamplingTensors:
    """The per-row parameters of one step, [B] each on the device, built host-side once per step."""

    greedy: torch.Tensor  # bool
    temperature: torch.Tensor  # float32 (1 on greedy rows)
    top_k: torch.Tensor  # int64, 0 = off
    top_p_cut: torch.Tensor  # float32: 1 - top_p, rounded from float64 as today's comparison does; 0 = off
    penalty: torch.Tensor  # float32, 1 = off
    seed: torch.Tensor  # int64
    step: torch.Tensor  # int64: the noise counter (e.g. tokens this request has drawn in this stage)
    # host-side flags, so unused rules cost nothing without reading the device. Turning a flag on
    # never changes a result (every rule is the identity on its "off" rows): a graph can be captured
    # with all of them on.
    any_sampled: bool
    max_top_k: int
    any_top_p: bool
    any_penalty: bool

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int],
              device: torch.device | str, graph: bool = False) -> "SamplingTensors":
        """seeds: any Python ints (mapped by `noise.seed_to_int64`); two host-to-device copies.
        graph: for a captured step: `max_top_k` rounded up to a power of two, so few graph
        variants cover every batch (the per-row k still applies exactly)."""
        sampled = [not p.is_greedy for p in params]
        temp = [p.temperature if s else 1.0 for p, s in zip(params, sampled)]
        top_k = [p.top_k if s else 0 for p, s in zip(params, sampled)]
        cut = [1.0 - p.top_p if s else 0.0 for p, s in zip(params, sampled)]
        pen = [p.repetition_penalty for p in params]
        floats = torch.tensor([temp, cut, pen], dtype=torch.float32).reshape(3, len(params)).to(device)
        ints = torch.tensor([[int(not s) for s in sampled], top_k, [noise.seed_to_int64(s) for s in seeds],
                             list(steps)], dtype=torch.int64).reshape(4, len(params)).to(device)
        return cls(greedy=ints[0] != 0, temperature=floats[0], top_k=ints[1], top_p_cut=floats[1],
                   penalty=floats[2], seed=ints[2], step=ints[3], any_sampled=any(sampled),
                   max_top_k=_graph_width(max(top_k, default=0)) if graph else max(top_k, default=0),
                   any_top_p=any(c > 0 for c in cut),
                   any_penalty=any(p != 1.0 for p in pen))


PAD_PARAMS = SamplingParams(greedy=True)  # the rows that pad a batch to a graph's size


def _graph_width(k: int) -> int:
    return 0 if k <= 0 else 1 << (k - 1).bit_length()


def seen_mask(ids: Sequence[Sequence[int]], vocab: int, device: torch.device | str) -> torch.Tensor:
    """Host-side helper: per-row id lists -> [B, V] bool (one copy of a padded id matrix)."""
    width = max((len(r) for r in ids), default=0)
    padded = torch.tensor([list(r) + [vocab] * (width - len(r)) for r in ids], dtype=torch.int64)
    padded = padded.reshape(len(ids), width).to(device)
    mask = torch.zeros(len(ids), vocab + 1, dtype=torch.bool, device=device)
    return mask.scatter_(1, padded, True)[:, :vocab]


# ---- rules, [B, V] in and out ------------------------------------------------------------------
def penalize(x: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """x [B, V], seen [B, V] bool, penalty [B]: seen positive logits / p, negative * p."""
    p = penalty[:, None]
    return torch.where(seen, torch.where(x < 0, x * p, x / p), x)


def top_k_mask(x: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Today's rule: drop logits below the k-th largest (ties with it stay); k = 0 or >= V is off."""
    vocab = x.shape[-1]
    width = max(1, min(max_top_k, vocab))
    values = torch.topk(x, width, dim=-1).values  # [B, width], descending
    kth = values.gather(1, (top_k - 1).clamp(0, width - 1)[:, None])  # [B, 1]
    on = (top_k > 0) & (top_k < vocab)
    return x.masked_fill((x < kth) & on[:, None], float("-inf"))


def top_p_mask(x: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """HF rule: sort ascending, drop where the cumulative probability <= 1 - top_p (= cut), always
    keep the most likely token; cut = 0 is off. The sort is stable, so ties break by id."""
    ordered, order = torch.sort(x, dim=-1, descending=False, stable=True)  # [B, V]
    cum = ordered.softmax(dim=-1).cumsum(dim=-1)
    keep_last = torch.arange(x.shape[-1], device=x.device) == x.shape[-1] - 1  # [V]
    drop = (cum <= cut[:, None]) & ~keep_last & (cut > 0)[:, None]
    return x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))


def failed_rows(*scores: torch.Tensor) -> torch.Tensor:
    """[B] bool: a row of any of the [B, V] tensors holds NaN or +inf, or is all -inf."""
    bad = None
    for s in scores:
        b = (torch.isnan(s) | torch.isposinf(s)).any(dim=-1) | torch.isneginf(s).all(dim=-1)
        bad = b if bad is None else bad | b
    return bad


def warp(x: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Temperature, top-k and top-p of the sampled rows; x [B, V] -> [B, V] with -inf removed."""
    x = x / t.temperature[:, None]
    if t.max_top_k > 0:
        x = top_k_mask(x, t.top_k, t.max_top_k)
    if t.any_top_p:
        x = top_p_mask(x, t.top_p_cut)
    return x


def sample(logits: torch.Tensor, t: SamplingTensors, stream: int, *, seen: torch.Tensor | None = None,
           suppress: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] (computed in float32) -> ids [B] int64, -1 on rows with unusable logits.

    seen [B, V] bool: ids the repetition penalty applies to. suppress [V] or [B, V] bool: ids
    never chosen. stream: `noise` stream of the stage (THINKER, TALKER, code_predictor(g), ...).
    Greedy rows are exactly `argmax` of the processed fp32 logits (first index on ties)."""
    x = logits.float()
    if seen is not None and t.any_penalty:
        x = penalize(x, seen, t.penalty)
    if suppress is not None:
        x = x.masked_fill(suppress, float("-inf"))
    if not t.any_sampled:
        return torch.where(failed_rows(x), FAILED, x.argmax(dim=-1))
    w = warp(x, t)
    drawn = w + noise.gumbel(t.seed, stream, t.step, x.shape[-1])  # Gumbel-max: exact categorical
    scores = torch.where(t.greedy[:, None], x, drawn)  # [B, V]
    return torch.where(failed_rows(x, w), FAILED, scores.argmax(dim=-1))


def draw_one(logits: torch.Tensor, params: SamplingParams, seed: int, stream: int, step: int, *,
             seen_ids: Sequence[int] | None = None, suppress: torch.Tensor | None = None) -> int:
    """One row through `sample`, for the reference loops (they may read the device): the same
    draw a batched stage makes for this (seed, stream, step). logits [V]."""
    t = SamplingTensors.build([params], [seed], [step], logits.device)
    seen = seen_mask([list(seen_ids)], logits.shape[-1], logits.device) if seen_ids is not None and t.any_penalty else None
    tok = int(sample(logits[None], t, stream, seen=seen, suppress=suppress)[0])
    if tok == FAILED:
        raise SamplingError("sampling failed: the logits hold no valid distribution for these sampling values")
    return tok
