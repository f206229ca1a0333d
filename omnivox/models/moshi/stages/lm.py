"""Moshi's LM as a paged AR stage: one position per frame, decode only (no prompt), its KV on the
paged pool under a sliding window of `context` positions (`ARAdmission.window`: moshi's ring
`delta < context`). Each step, every session whose next user frame arrived computes one frame:
the temporal transformer over its text, model and user streams, the text token sampled, then the
depformer's inner loop over the dep_q codebooks (`MoshiLM.depth`, like the Talker's code
predictor), batched over the sessions.

The frame loop is `LMGen.step`'s, kept on the host per session (`Session`): the user's codes
(`DuplexRequest.user`, written by the encoder stage), and `made`, what each step sampled (text,
then the dep_q codes). Position p's input, per stream k with delay d_k:
- the initial token (text_card for text, card for audio) while p <= d_k;
- text and model audio: what step p - 1 made (the streams are delayed by their meaning, not here);
- user audio: the user's codes of frame p - d_k.
Step p outputs, de-delayed, stream k of what step p - max_delay + d_k made, once p >= max_delay
(LMGen returns None before): the text token (a `TextDelta` unless padding; every frame's id is
in `text_ids`) and the dep_q codes (a frame for the vocoder stage).

A sequence's known inputs (`num_tokens`) grow one position at a time: position p is known once
step p - 1 made its tokens and frame p arrived, so frames that arrive together still compute one
per step. Windowed sequences keep out of the prefix cache (no key items). A preempted session
recomputes its positions from these host records (prefill chunks; the sampling only at the last).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnivox.engine import host
from omnivox.engine.config import EngineConfig
from omnivox.engine.scheduler import Seq
from omnivox.engine.stage import Failures
from omnivox.models.moshi.lm import MoshiLM
from omnivox.models.moshi.lm_sampling import GREEDY, MoshiSampler
from omnivox.models.moshi.stages.request import DuplexRequest
from omnivox.models.moshi.tokenizer import MoshiTokenizer
from omnivox.sampling.batched import SamplingError
from omnivox.stages.admission import SeqState
from omnivox.stages.ar import ARAdapter
from omnivox.stages.step import PagedContext, StepBatch, StepResult


@dataclass(eq=False)
class Session(SeqState):
    req: DuplexRequest
    received: int = 0  # user frames the encoder passed on (at most the session's max_frames)
    closed: bool = False  # no more will come
    made: list[list[int]] = field(default_factory=list)  # per computed step: text, then dep_q codes


@dataclass
class LMStepInputs:
    tokens: torch.Tensor  # [N, 1 + n_q] long: each position's input per stream
    positions: torch.Tensor  # [N] long
    step: torch.Tensor  # [M] long: each sampling row's frame index (the sampling noise's counter)
    sampler: MoshiSampler  # [M] rows


@dataclass
class LMStepOutputs:
    tokens: torch.Tensor  # [M, 1 + dep_q] long: text, then the model's codes (-1: sampling failed)


class _Rows:
    """`KVCache.attend` for one token per row ([N, 1, H, D]) over a paged step's flat tokens."""

    def __init__(self, ctx: PagedContext):
        self.ctx = ctx

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.ctx.attend(layer, q[:, 0], k[:, 0], v[:, 0])[:, None]


class MoshiLMAdapter(ARAdapter[Session]):
    def __init__(self, lm: MoshiLM, tokenizer: MoshiTokenizer, cfg: EngineConfig):
        self.lm, self.mcfg, self.tokenizer, self.cfg = lm, lm.cfg, tokenizer, cfg
        self.device = lm.device
        self.window = lm.cfg.transformer.context
        self.delays = list(self.mcfg.delays)
        self.initial = [self.mcfg.text_card] + [self.mcfg.card] * self.mcfg.n_q
        self.states: dict[str, Session] = {}

    # ---- admission (ARAdmission) ----------------------------------------------------------
    def can_start(self, req: DuplexRequest) -> bool:
        return req.encoded.pending()  # the first frame (or the end of a session without any)

    def start(self, req: DuplexRequest) -> Seq | None:
        """The session's sequence, with its first frame known (None: it ended before any frame)."""
        st = self.states[req.rid] = Session(req, seq=Seq(req.rid, req.order, 0, req.max_frames,
                                                         block_size=self.cfg.block_size))
        self._take(st)
        if st.received == 0:
            st.seq = None
            return None
        return st.seq

    def inputs_arrived(self) -> bool:
        return any(not st.done and st.req.encoded.pending() for st in self.states.values())

    def prepare_step(self) -> Failures:
        """Take the frames the encoder passed on; a session at its maximum length closes its input
        (the caller's later pushes are refused) and ends with "length"."""
        for st in self.states.values():
            if st.seq is not None:
                self._take(st)
        return []

    def _take(self, st: Session) -> None:
        req = st.req
        if st.done or st.closed or not req.encoded.pending():
            return
        segs, st.closed = req.encoded.take()
        st.received += sum(len(s.ids) for s in segs)
        if st.received >= req.max_frames and not st.closed:
            req.finish_reason = "length"
            req.stream.close()
            st.closed = True
        st.received = min(st.received, req.max_frames)
        self._advance(st)

    def _advance(self, st: Session) -> bool:
        """Extend the known positions; end the session once its last frame is computed (True)."""
        st.seq.num_tokens = max(st.seq.num_tokens, min(st.received, len(st.made) + 1))
        if st.closed and len(st.made) == st.received and not st.done:
            st.done = True
            st.req.frames.final = True
            return True
        return False

    def max_len(self) -> int:
        return max(1, self.stage.alloc.num_blocks * self.cfg.block_size)

    # ---- the step (ARStep) ----------------------------------------------------------------
    def _input(self, st: Session, p: int) -> list[int]:
        out, user, dep = [], st.req.user.codes, self.mcfg.dep_q
        for k, d in enumerate(self.delays):
            if p <= d:
                out.append(self.initial[k])
            elif k <= dep:
                out.append(st.made[p - 1][k])
            else:
                out.append(user[p - d][k - dep - 1])
        return out

    def inputs(self, batch: StepBatch) -> LMStepInputs:
        tokens, positions = [], []
        for r in batch.rows:
            st = self.states[r.req.rid]
            for p in range(r.start, r.end):
                tokens.append(self._input(st, p))
                positions.append(p)
        pad = batch.pad
        tokens += [[-1] * len(self.delays)] * pad  # moshi's zero token: no input
        positions += [0] * pad
        reqs = [self.states[r.req.rid].req for r in batch.sampled_rows]
        steps = [r.end - 1 for r in batch.sampled_rows] + [0] * pad
        dev = self.device
        sampler = MoshiSampler.build([q.params for q in reqs] + [GREEDY] * pad, [q.seed for q in reqs] + [0] * pad, dev)
        return LMStepInputs(torch.tensor(tokens, dtype=torch.long, device=dev).view(-1, len(self.delays)),
                            torch.tensor(positions, dtype=torch.long, device=dev),
                            torch.tensor(steps, dtype=torch.long, device=dev), sampler)

    def compute(self, inp: LMStepInputs, ctx: PagedContext) -> LMStepOutputs | None:
        """The temporal transformer over every position, then for the sampling rows the text token
        and the depformer's frame (sampling inside)."""
        h = self.lm.temporal(inp.tokens, inp.positions, _Rows(ctx))  # [N, 1, dim]
        if not ctx.any_sampled():
            return None
        h = ctx.sampled(h)  # [M, 1, dim]
        text = inp.sampler.text(self.lm.text_linear(h)[:, 0].float(), inp.step)
        audio = self.lm.depth(text, h, inp.sampler, inp.step)  # [M, dep_q]
        return LMStepOutputs(torch.cat([text[:, None], audio], dim=1))

    def apply(self, batch: StepBatch, out: LMStepOutputs | None) -> StepResult:
        result = StepResult.none(len(batch.rows))
        if not batch.sampled:
            return result
        for i, made in zip(batch.sampled, host.ids(out.tokens)):  # the step's one read of the device
            st = self.states[batch.rows[i].req.rid]
            if min(made) < 0:
                result.failures.append((st.req, SamplingError(
                    "sampling failed: the LM's logits hold no valid distribution for these sampling values")))
                continue
            result.accepted[i] = 1
            st.made.append(made)
            if len(st.made) > self.mcfg.max_delay:
                self._emit(st)
            if self._advance(st):
                result.finished.append(st.req)
        return result

    def _emit(self, st: Session) -> None:
        """Step p's output, de-delayed: stream k of what step p - max_delay + d_k made."""
        q = len(st.made) - 1 - self.mcfg.max_delay
        tok = [st.made[q + d][k] for k, d in enumerate(self.delays[:self.mcfg.dep_q + 1])]
        req = st.req
        req.text_ids.append(tok[0])
        piece = self.tokenizer.piece(tok[0])
        if piece:
            req.text += piece
            req.emit_text(piece, [tok[0]])
        req.frames.append(tok[1:])
