"""S2 Pro's sampling rules (spec 10), batched and generator-free, on the counter noise.

Both modes run in one pass; rows choose theirs with `torch.where`:

fish ("fish", fish-speech): constrained logits -> top-p (drop the crossing token) and top-k on
UNTEMPERED logits -> / max(temperature, 1e-5) -> Gumbel-max draw (== fish-speech's exponential
race). RAS: on decode steps (steps > 0) a second candidate at ras_temperature / ras_top_p and the
same top-k, taken when the normal draw is a semantic id already in the last-`ras_window` window
(zeros at start; the prefill token is never inserted).

sglang ("sglang", SGLang-Omni 0.1.9): constrained logits rounded to bf16 -> RAS switch to
ras_temperature / ras_top_p when the last `sgl_ras_window` tokens hold a duplicate and at least
that many were drawn -> repetition penalty over the last `penalty_window` tokens -> top-k
(<= 30; 0 means 30) -> top-p (crossing rule) -> temperature -> Gumbel draw keyed on (seed, step).

Greedy rows (a temperature below `GREEDY_TEMPERATURE`, 0 included): the argmax of the constrained
logits (sglang rows: penalised too), no RAS; their residual codes are argmax as well
(`residual_is_greedy`). Deterministic, like greedy decoding in every other stage.

Residual codes c1..: fish rows sample with the semantic temperature / top-p / top-k over all K
logits, sglang rows take the argmax (per-row override: `greedy_residual`); `mask_residual_overflow`
forbids codes >= residual_size.

The device contract is that of `omnivox.sampling.batched`: no host reads, an op count fixed by
the host flags of `FishTensors` (not by the batch size), and id -1 for a row whose logits are
unusable (NaN or +inf, or all -inf).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from omnivox.errors import InputError
from omnivox.layers.streaming_conv import BatchedState
from omnivox.sampling import noise
from omnivox.sampling.batched import FAILED, failed_rows, penalize



class SemanticVocab(Protocol):
    """Where a family's semantic tokens lie in its vocabulary (Fish S2: `FishConfig`)."""
    semantic_begin: int
    semantic_end: int
    eos_id: int


class FishSampling(Protocol):
    """One request's sampling settings as these rules read them (Fish S2: `FishSamplingParams`)."""
    mode: str  # "fish" | "sglang"
    temperature: float
    greedy: bool  # argmax in both ARs (a temperature below GREEDY_TEMPERATURE)
    top_p: float
    top_k: int
    repetition_penalty: float
    ras_temperature: float
    ras_top_p: float
    ras_window: int
    sgl_ras_window: int
    penalty_window: int
    residual_is_greedy: bool
    mask_residual_overflow: bool

SGL_TOPK_WIDTH = 30
RAS_WIDTH = 10  # columns of FishState.window
HISTORY_WIDTH = 16  # columns of FishState.history
TEMPERATURE_FLOOR = 1e-5


@dataclass
class FishState(BatchedState):
    """Sampler memory of one request slot per row (batch-first: select / concat work)."""

    window: torch.Tensor  # [B, RAS_WIDTH] int64: fish RAS window, zeros at start
    history: torch.Tensor  # [B, HISTORY_WIDTH] int64: recent tokens, oldest first, -1 = empty
    steps: torch.Tensor  # [B] int64: tokens drawn so far (0 = the prefill step)

    @classmethod
    def fresh(cls, batch: int, device: torch.device | str | None = None, *, ras_width: int = RAS_WIDTH,
              history_width: int = HISTORY_WIDTH) -> "FishState":
        return cls(torch.zeros(batch, ras_width, dtype=torch.int64, device=device),
                   torch.full((batch, history_width), -1, dtype=torch.int64, device=device),
                   torch.zeros(batch, dtype=torch.int64, device=device))


@dataclass
class FishTensors:
    """The per-row parameters of one step, [B] each on the device, built host-side once per step."""

    sglang: torch.Tensor  # bool: row uses the SGLang-Omni rules
    greedy: torch.Tensor  # bool: the semantic token is the argmax (no draw, no RAS)
    temperature: torch.Tensor  # float32
    top_p: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, 0 = off (the residual draw)
    semantic_top_k: torch.Tensor  # int64: top_k of the semantic draw (sglang: 0 -> 30, at most 30)
    ras_temperature: torch.Tensor  # float32
    ras_top_p: torch.Tensor  # float32
    penalty: torch.Tensor  # float32: sglang repetition penalty (1 on fish rows)
    ras_window: torch.Tensor  # int64: fish window length, <= the state's window width
    sgl_ras_window: torch.Tensor  # int64
    penalty_window: torch.Tensor  # int64
    residual_greedy: torch.Tensor  # bool
    mask_overflow: torch.Tensor  # bool
    seed: torch.Tensor  # int64
    # host-side flags; turning one on never changes a result (a graph can capture all on)
    any_fish: bool
    any_sglang: bool
    any_greedy: bool
    any_residual_sampled: bool
    any_overflow_mask: bool

    @classmethod
    def build(cls, params: Sequence[FishSampling], seeds: Sequence[int], device: torch.device | str, *,
              ras_width: int = RAS_WIDTH, history_width: int = HISTORY_WIDTH) -> "FishTensors":
        """seeds: any Python ints (`noise.seed_to_int64`); windows are checked against the state
        widths. Two host-to-device copies."""
        for p in params:
            if p.ras_window > ras_width or max(p.penalty_window, p.sgl_ras_window) > history_width:
                raise InputError(f"sampler windows ({p.ras_window}, {p.sgl_ras_window}, {p.penalty_window}) "
                                 f"exceed the state widths ({ras_width}, {history_width})")
        sgl = [p.mode == "sglang" for p in params]
        floats = [[p.temperature for p in params], [p.top_p for p in params], [p.ras_temperature for p in params],
                  [p.ras_top_p for p in params], [p.repetition_penalty if s else 1.0 for p, s in zip(params, sgl)]]
        ints = [sgl, [p.greedy for p in params], [p.top_k for p in params],
                [_semantic_top_k(p.top_k, s) for p, s in zip(params, sgl)],
                [p.ras_window for p in params], [p.sgl_ras_window for p in params],
                [p.penalty_window for p in params], [p.residual_is_greedy for p in params],
                [p.mask_residual_overflow for p in params], [noise.seed_to_int64(s) for s in seeds]]
        f = torch.tensor(floats, dtype=torch.float32).reshape(len(floats), len(params)).to(device)
        i = torch.tensor([[int(v) for v in col] for col in ints], dtype=torch.int64)
        i = i.reshape(len(ints), len(params)).to(device)
        return cls(sglang=i[0] != 0, greedy=i[1] != 0, temperature=f[0], top_p=f[1], top_k=i[2],
                   semantic_top_k=i[3],
                   ras_temperature=f[2], ras_top_p=f[3], penalty=f[4], ras_window=i[4], sgl_ras_window=i[5],
                   penalty_window=i[6], residual_greedy=i[7] != 0, mask_overflow=i[8] != 0, seed=i[9],
                   any_fish=not all(sgl), any_sglang=any(sgl), any_greedy=any(p.greedy for p in params),
                   any_residual_sampled=not all(p.residual_is_greedy for p in params),
                   any_overflow_mask=any(p.mask_residual_overflow for p in params))


def _semantic_top_k(top_k: int, sglang: bool) -> int:
    if not sglang:
        return top_k
    return min(top_k, SGL_TOPK_WIDTH) if top_k > 0 else SGL_TOPK_WIDTH


# ---- rules ---------------------------------------------------------------------------------------
def semantic_bias(cfg: SemanticVocab, vocab: int, device: torch.device | str) -> torch.Tensor:
    """[V] float32: 0 for the semantic ids and <|im_end|>, -inf elsewhere (constrained decoding)."""
    ids = torch.arange(vocab, device=device)
    allowed = ((ids >= cfg.semantic_begin) & (ids <= cfg.semantic_end)) | (ids == cfg.eos_id)
    return torch.where(allowed, 0.0, float("-inf"))


def filter_top_p_top_k(x: torch.Tensor, top_k: torch.Tensor, *top_ps: torch.Tensor) -> list[torch.Tensor]:
    """fish-speech rule on untempered x [B, V], once per top_p [B] (one shared sort): remove ranks
    whose cumulative probability exceeds top_p (so the crossing token too) and ranks >= top_k
    (0 = off); rank 0 always stays. The sort is stable, so ties break by id."""
    ordered, order = x.sort(dim=-1, descending=True, stable=True)  # [B, V]
    cum = ordered.softmax(dim=-1).cumsum(dim=-1)
    rank = torch.arange(x.shape[-1], device=x.device)  # [V]
    by_rank = ((top_k[:, None] > 0) & (rank >= top_k[:, None])) & (rank != 0)  # [B, V]
    out = []
    for p in top_ps:  # one or two thresholds, never one per row
        remove = by_rank | ((cum > p[:, None]) & (rank != 0))
        out.append(x.masked_fill(torch.zeros_like(remove).scatter(1, order, remove), float("-inf")))
    return out


def tempered(kept: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """[B, V] / max(temperature, 1e-5) per row."""
    return kept / temperature.clamp(min=TEMPERATURE_FLOOR)[:, None]


def gumbel_argmax(scores: torch.Tensor, seed: torch.Tensor, stream: int, step: torch.Tensor) -> torch.Tensor:
    """Exact categorical draw from softmax(scores) [B, V] -> [B]."""
    return (scores + noise.gumbel(seed, stream, step, scores.shape[-1])).argmax(dim=-1)


def _last(n: torch.Tensor, width: int, device) -> torch.Tensor:
    """[B, width] bool: the last n[b] columns of a ring of `width` columns."""
    return torch.arange(width, device=device)[None] >= width - n[:, None]


def sglang_repeat(history: torch.Tensor, steps: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """[B] bool: the last window[b] tokens of history [B, H] hold a duplicate and steps >= window."""
    valid = (history >= 0) & _last(window, history.shape[1], history.device)  # [B, H]
    pairs = (history[:, :, None] == history[:, None, :]) & valid[:, :, None] & valid[:, None, :]  # [B, H, H]
    return (pairs.sum(dim=(1, 2)) > valid.sum(dim=1)) & (steps >= window)


def recent_mask(history: torch.Tensor, window: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] bool: ids among the last window[b] entries of history (-1 = empty)."""
    valid = (history >= 0) & _last(window, history.shape[1], history.device)
    idx = torch.where(valid, history, vocab)  # invalid entries go to a spare column
    mask = torch.zeros(history.shape[0], vocab + 1, dtype=torch.bool, device=history.device)
    return mask.scatter(1, idx, True)[:, :vocab]


def _push(ring: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Shift tokens [B] into the end of ring [B, W] (only where rows [B] is True, if given)."""
    shifted = torch.cat((ring[:, 1:], tokens[:, None]), dim=1)
    return shifted if rows is None else torch.where(rows[:, None], shifted, ring)


# ---- the two samplers --------------------------------------------------------------------------
def sample_semantic(logits: torch.Tensor, t: FishTensors, state: FishState, cfg: SemanticVocab) -> torch.Tensor:
    """Slow-AR logits [B, V] -> token ids [B] (-1 on unusable rows). Updates `state` in place
    (copy_, so static graph buffers stay valid): window for fish decode rows, history and steps
    for every row."""
    x = logits.float() + semantic_bias(cfg, logits.shape[-1], logits.device)  # [B, V]
    temperature, top_p = t.temperature, t.top_p
    if t.any_sglang:
        sgl_x = penalize(x.to(torch.bfloat16).float(), recent_mask(state.history, t.penalty_window, x.shape[-1]),
                         t.penalty)
        x = torch.where(t.sglang[:, None], sgl_x, x)
        ras = t.sglang & sglang_repeat(state.history, state.steps, t.sgl_ras_window)
        temperature = torch.where(ras, t.ras_temperature, temperature)
        top_p = torch.where(ras, t.ras_top_p, top_p)
    top_ps = (top_p, t.ras_top_p) if t.any_fish else (top_p,)
    kept = filter_top_p_top_k(x, t.semantic_top_k, *top_ps)
    scores = tempered(kept[0], temperature)
    tokens = gumbel_argmax(scores, t.seed, noise.FISH_SEMANTIC, state.steps)
    bad = failed_rows(x, scores)
    decode = state.steps > 0
    if t.any_greedy:  # greedy rows: the argmax, and no RAS below
        tokens = torch.where(t.greedy, x.argmax(dim=-1), tokens)
        bad = torch.where(t.greedy, failed_rows(x), bad)
        decode = decode & ~t.greedy
    if t.any_fish:
        ras_rows = ~t.sglang & decode  # fish RAS runs on decode steps only
        ras_scores = tempered(kept[1], t.ras_temperature)
        fallback = gumbel_argmax(ras_scores, t.seed, noise.FISH_RAS, state.steps)
        semantic = (tokens >= cfg.semantic_begin) & (tokens <= cfg.semantic_end)
        in_window = ((state.window == tokens[:, None]) & _last(t.ras_window, state.window.shape[1], x.device)).any(1)
        tokens = torch.where(ras_rows & semantic & in_window, fallback, tokens)
        bad = bad | (ras_rows & failed_rows(ras_scores))
        state.window.copy_(_push(state.window, tokens, ras_rows))
    tokens = torch.where(bad, FAILED, tokens)
    state.history.copy_(_push(state.history, tokens))
    state.steps.add_(1)
    return tokens


def sample_residual(logits: torch.Tensor, t: FishTensors, steps: torch.Tensor, codebook: int,
                    residual_size: int) -> torch.Tensor:
    """Fast-AR logits [B, K] of residual codebook `codebook` (1..) -> codes [B] (-1 on unusable
    rows). steps [B]: any per-frame counter of the row (the stage passes `state.steps`)."""
    x = logits.float()
    if t.any_overflow_mask:
        overflow = torch.arange(x.shape[-1], device=x.device) >= residual_size  # [K]
        x = x.masked_fill(t.mask_overflow[:, None] & overflow[None], float("-inf"))
    if not t.any_residual_sampled:
        return torch.where(failed_rows(x), FAILED, x.argmax(dim=-1))
    scores = tempered(filter_top_p_top_k(x, t.top_k, t.top_p)[0], t.temperature)
    drawn = scores + noise.gumbel(t.seed, noise.fish_residual(codebook), steps, x.shape[-1])
    choice = torch.where(t.residual_greedy[:, None], x, drawn).argmax(dim=-1)
    bad = failed_rows(x) | (~t.residual_greedy & failed_rows(scores))
    return torch.where(bad, FAILED, choice)
