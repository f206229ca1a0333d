"""The Talker as a paged AR stage: it starts as soon as the Thinker's prompt hidden states and
first voiced token exist, samples code0 for every running request each step, and completes
each frame with the code predictor's 15 inner steps, batched over the requests. Frame s waits
for voiced token s+1 (or the end of the text), so the Talker follows the Thinker closely."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from omnivox.engine import host
from omnivox.engine.config import EngineConfig
from omnivox.engine.events import StageStats
from omnivox.engine.scheduler import Seq
from omnivox.engine.stage import Failures
from omnivox.errors import InputError
from omnivox.models.qwen3_omni.media import media_in_spans, positions, suppress_mask
from omnivox.models.qwen3_omni.model import Qwen3OmniModel
from omnivox.models.qwen3_omni.stages.request import QwenRequest
from omnivox.models.qwen3_omni.talker_prompt import TalkerInputs
from omnivox.sampling import noise
from omnivox.sampling.batched import PAD_PARAMS, SamplingTensors, sample, seen_mask
from omnivox.stages.admission import SeqState
from omnivox.stages.frames import SpeechARAdapter
from omnivox.stages.step import PagedContext, StepBatch, StepResult


@dataclass(eq=False)
class TalkerState(SeqState):
    req: QwenRequest
    rows: list[torch.Tensor] = field(default_factory=list)  # input rows: the prefill, then one per frame
    positions: np.ndarray | None = None  # [3, L] float32 prefill positions
    delta: float = 0.0
    pending: torch.Tensor | None = None  # the last frame's embedding, waiting for its text input
    history: list[int] = field(default_factory=list)  # code0 draws (the repetition penalty's ids)


@dataclass
class TalkerStepInputs:
    """One Talker step: input rows and M-RoPE positions, and for the sampling rows their sampling
    values (code0's and the code predictor's), code0 history and which may end."""

    x: torch.Tensor  # [N, H]
    positions: torch.Tensor  # [3, N] float32
    talker: SamplingTensors  # [M] code0
    code_predictor: SamplingTensors  # [M]
    seen: torch.Tensor  # [M, V] bool: code0 history (the repetition penalty)
    ignore_eos: torch.Tensor  # [M] long 0/1: codec EOS suppressed


@dataclass
class TalkerStepOutputs:
    frames: torch.Tensor  # [M, Q] codes (-1: sampling failed)
    frame_emb: torch.Tensor  # [M, H] each frame's embedding: its row's next input


class TalkerAdapter(SpeechARAdapter[TalkerState]):
    def __init__(self, model: Qwen3OmniModel, cfg: EngineConfig):
        self.model, self.cfg, self.mcfg = model, cfg, model.cfg
        self.device, self.dtype = model.device_of("talker"), model.talker.codec_head.weight.dtype
        self.talker_inputs = TalkerInputs(model)
        self.suppress = torch.stack([suppress_mask(self.mcfg, self.device, flag) for flag in (False, True)])  # [2, V]
        self.states: dict[str, TalkerState] = {}
        self.cp_stats = StageStats()
        self.cp_cache = model.talker.code_predictor.new_cache(rows=cfg.max_running)

    # ---- admission (ARAdmission): a request's sequence and its inputs --------------------------
    def max_len(self) -> int:
        return self.mcfg.talker.text.max_position_embeddings or super().max_len()

    def on_admit(self, req: QwenRequest) -> None:
        """At admission: the prefill's layout and 3-D positions (they depend on the prompt only;
        for a streamed prompt, once it is complete)."""
        st = self.states[req.rid] = TalkerState(req)
        if req.stream is None:
            self._layout(st)

    def _layout(self, st: TalkerState) -> None:
        req = st.req
        try:
            ids, spans = self.talker_inputs.layout(req.prompt.ids, req.opts.talker_instruction_ids)
        except ValueError as e:
            raise InputError(f"speech output needs the chat layout: {e}") from None
        pos, st.delta = positions(self.mcfg, ids, media_in_spans(req.prompt, spans, self.mcfg), talker=True)
        st.positions = pos.to(torch.float32).numpy()

    def can_start(self, req: QwenRequest) -> bool:
        """Once the Thinker's prompt hidden states and first voiced token exist, or the reply
        cannot be voiced: until then (a streamed prompt while the user speaks) it is no work."""
        v = req.voiced
        return self._unvoiced(req) or (bool(v.ids) and v.hidden_done >= req.prompt_tokens)

    @staticmethod
    def _unvoiced(req: QwenRequest) -> bool:
        return req.voiced.too_short() or req.opts.max_frames <= 0

    @torch.no_grad()
    def start(self, req: QwenRequest) -> Seq | None:
        """The prefill rows (`can_start` holds), or the end of a reply that cannot be voiced."""
        st = self.states[req.rid]
        v = req.voiced
        if self._unvoiced(req):
            self.end_frames(req, "stop")
            return None
        if st.positions is None:  # a streamed prompt, complete now that the Thinker answers
            self._layout(st)
        pre = self.talker_inputs.prefill(req.prompt.ids, v.hidden, v.ids[0], req.opts.speaker_id,
                                         req.opts.talker_instruction_ids)
        st.rows = list(pre.embeds)
        L = len(pre.input_ids)
        st.seq = Seq(req.rid, req.order, num_tokens=L, max_tokens=L + req.opts.max_frames)
        return st.seq

    def samples(self, row) -> bool:
        """A row ending at input e samples frame e - L (L: the prefill's length), unless that frame
        exists: a sequence preempted while its last frame waited for text is recomputed up to that
        frame's input, which was sampled already (sampling it again would repeat the frame)."""
        st = self.states[row.req.rid]
        return row.end - st.positions.shape[1] >= len(row.req.frames)

    def prepare_step(self) -> Failures:
        self._feed([st for st in self.states.values() if st.pending is not None])
        return []

    def inputs_arrived(self) -> bool:
        return any(st.pending is not None and st.req.voiced.for_frame(len(st.req.frames) - 1)[0]
                   for st in self.states.values())

    def _feed(self, states: list[TalkerState]) -> None:
        """Complete frames' inputs whose text is now known: frame embedding + projected text."""
        ready, ids = [], []
        for st in states:
            ok, tok, final = st.req.voiced.for_frame(len(st.req.frames) - 1)
            if ok:
                ready.append(st)
                ids.append(self.mcfg.tts_pad_token_id if tok is None else self.mcfg.tts_eos_token_id if final else tok)
        if not ready:
            return
        with torch.no_grad():
            text = self.talker_inputs.project_text(ids)  # [M, H]
        for st, row in zip(ready, text):
            st.rows.append(st.pending + row)
            st.pending = None
            st.seq.num_tokens += 1

    # ---- the step (ARStep): inputs (host) -> compute (device) -> apply (host) -----------------
    def inputs(self, batch: StepBatch) -> TalkerStepInputs:
        """Input rows [N, H], positions [3, N], and for the sampled rows: their sampling values
        (code0 and the code predictor's), the code0 history the repetition penalty reads, and
        which may end (codec EOS allowed unless `ignore_eos`)."""
        rows, pad = batch.rows, batch.pad
        xs, pos = [], []
        for r in rows:
            st = self.states[r.req.rid]
            L = st.positions.shape[1]
            xs.extend(st.rows[r.start:r.end])
            if r.start < L:
                pos.append(st.positions[:, r.start:min(r.end, L)])
            if r.end > L:
                s = max(r.start, L)
                pos.append(np.broadcast_to(L + st.delta + (s - L) + np.arange(r.end - s, dtype=np.float32),
                                           (3, r.end - s)))
        width = self.mcfg.talker.text.hidden_size
        x = torch.stack(xs) if xs else torch.zeros(0, width, device=self.device, dtype=self.dtype)
        if pad:
            x = torch.cat([x, x.new_zeros(pad, width)])
        pos.append(np.zeros((3, pad), np.float32))
        states = [self.states[r.req.rid] for r in batch.sampled_rows]
        reqs = [st.req for st in states]
        g = pad > 0
        return TalkerStepInputs(
            x, torch.from_numpy(np.concatenate(pos, axis=1).astype(np.float32)).to(self.device),
            talker=SamplingTensors.build([q.opts.talker for q in reqs] + [PAD_PARAMS] * pad,
                                         [q.seed for q in reqs] + [0] * pad,
                                         [len(st.history) for st in states] + [0] * pad, self.device, graph=g),
            code_predictor=SamplingTensors.build([q.opts.code_predictor for q in reqs] + [PAD_PARAMS] * pad,
                                                 [q.seed for q in reqs] + [0] * pad,
                                                 [len(q.frames) for q in reqs] + [0] * pad, self.device, graph=g),
            seen=seen_mask([st.history for st in states] + [[]] * pad, self.mcfg.talker.text.vocab_size, self.device),
            ignore_eos=torch.tensor([int(q.opts.ignore_eos) for q in reqs] + [0] * pad, device=self.device))

    def compute(self, inp: TalkerStepInputs, ctx: PagedContext) -> TalkerStepOutputs | None:
        """The Talker forward, code0 for the sampled rows, then the code predictor completes each
        frame (15 inner steps, sampling inside); the frames' embeddings are the next inputs."""
        tk = self.model.talker
        h = tk(inp.x, inp.positions, ctx)
        if not ctx.any_sampled():  # a prefill chunk: nothing to sample yet
            return None
        h = ctx.sampled(h)  # [M, H]
        code0 = sample(tk.codec_head(h).float(), inp.talker, noise.TALKER, seen=inp.seen,
                       suppress=self.suppress.index_select(0, inp.ignore_eos))  # [M]
        t = inp.code_predictor
        codes = tk.code_predictor.frame(h, tk.model.codec_embedding(code0.clamp(min=0)),
                                        lambda logits, g: sample(logits, t, noise.code_predictor(g)), self.cp_cache)
        frames = torch.cat([code0[:, None], codes], dim=1)  # [M, Q]
        return TalkerStepOutputs(frames, tk.frame_embedding(frames.clamp(min=0)))  # [M, H]

    def apply(self, batch: StepBatch, out: TalkerStepOutputs | None) -> StepResult:
        if not batch.sampled:
            return StepResult.none(len(batch.rows))
        self.cp_stats.record(len(batch.sampled))
        got = host.ids(out.frames)  # the step's one read of the device
        frame_emb = out.frame_emb.clone()  # NOTE: a graph's output buffer is overwritten by its next replay
        for i, frame in zip(batch.sampled, got):
            if frame[0] >= 0:
                self.states[batch.rows[i].req.rid].history.append(frame[0])
        result, going = self.take_frames(batch, [(f[0], f) for f in got], self.mcfg.talker.codec_eos_token_id,
                                         "the Talker's logits")
        fed = []
        for j, row, _ in going:
            st = self.states[row.req.rid]
            st.pending = frame_emb[j]
            fed.append(st)
        self._feed(fed)
        return result

    # ---- admission (ARAdmission): the end and stats ------------------------------------------
    def frame_budget(self, req: QwenRequest) -> int:
        return req.opts.max_frames

    def end_frames(self, req: QwenRequest, reason: str) -> None:
        self.states[req.rid].done = True
        req.frames.final = True

    def stats(self) -> dict[str, StageStats]:
        return {"code_predictor": self.cp_stats}
