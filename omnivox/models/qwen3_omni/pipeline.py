"""Offline generation for one request: Thinker loop -> Talker loop (with the code
predictor per frame) -> Code2Wav. Equal to transformers' `generate` under greedy decoding.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from omnivox.errors import InputError
from omnivox.layers.attention import DenseKVCache
from omnivox.models.qwen3_omni.model import Qwen3OmniModel
from omnivox.models.qwen3_omni.positions import decode_positions, rope_index_for, talker_rope_index_for
from omnivox.models.qwen3_omni.talker_prompt import TalkerInputs
from omnivox.sampling.params import SamplingParams
from omnivox.sampling.sampler import choose, request_generators


@dataclass
class VisualItem:
    kind: str  # "image" | "video"
    pixel_values: torch.Tensor  # [N_patches, C*tp*p*p]
    grid: tuple[int, int, int]
    second_per_grid: float = 1.0


@dataclass
class PreparedPrompt:
    """Token ids with one placeholder per media token, and the media in placeholder order."""

    ids: list[int]
    audio_features: list[torch.Tensor] = field(default_factory=list)  # [n_mels, T] per clip
    audio_token_counts: list[int] = field(default_factory=list)
    visual: list[VisualItem] = field(default_factory=list)  # images and videos in prompt order


@dataclass(frozen=True)
class GenerationOptions:
    max_tokens: int = 1024
    max_frames: int = 4095
    thinker: SamplingParams = SamplingParams(greedy=True)
    talker: SamplingParams = SamplingParams(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)
    code_predictor: SamplingParams = SamplingParams(temperature=1.0, top_k=50, top_p=0.8)
    speaker_id: int | None = None
    return_audio: bool = True
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    talker_instruction_ids: tuple[int, ...] = ()  # a Talker-only user turn (voice, style)
    ignore_eos: bool = False  # benchmarks: run to the length limits (no end token, no codec EOS)
    speech_ids: tuple[int, ...] = ()  # text-to-speech: voice these ids as the assistant's text, no Thinker

    def thinker_stops(self, im_end: int) -> set[int]:
        return set() if self.ignore_eos else {im_end, *self.stop_token_ids}


@dataclass
class GenerationOutput:
    text_ids: list[int]
    codes: np.ndarray  # [frames, num_code_groups] int64
    audio: np.ndarray  # [samples] float32
    sample_rate: int
    finish_reason: str  # "stop" (end token) or "length"


class OfflineGenerator:
    """Runs requests one at a time on a loaded model (the reference-equal path)."""

    SAMPLE_RATE = 24000

    def __init__(self, model: Qwen3OmniModel):
        self.model, self.cfg = model, model.cfg
        self.talker_inputs = TalkerInputs(model) if self.cfg.has_audio_output else None
        self.device = model.thinker.lm_head.weight.device
        self.dtype = model.thinker.lm_head.weight.dtype

    # ---- media -----------------------------------------------------------------------
    def encode_media(self, p: PreparedPrompt) -> tuple[torch.Tensor | None, torch.Tensor | None, list[torch.Tensor]]:
        audio = vis = None
        deepstack: list[torch.Tensor] = []
        if p.audio_features:
            audio = self.model.thinker.audio_tower([f.to(self.device, self.dtype) for f in p.audio_features])
        if p.visual:
            pix = torch.cat([v.pixel_values for v in p.visual]).to(self.device, self.dtype)
            vis, deepstack = self.model.thinker.visual(pix, [v.grid for v in p.visual])
        return audio, vis, deepstack

    def positions(self, ids: list[int], p: PreparedPrompt, talker: bool = False) -> tuple[torch.Tensor, float]:
        images = [v.grid for v in p.visual if v.kind == "image"]
        videos = [v for v in p.visual if v.kind == "video"]
        media = dict(image_grids=images, video_grids=[v.grid for v in videos],
                     second_per_grids=[v.second_per_grid for v in videos], audio_token_counts=p.audio_token_counts)
        if talker:
            return talker_rope_index_for(self.cfg.thinker, self.cfg.talker, ids, **media)
        return rope_index_for(self.cfg.thinker, ids, **media)

    # ---- thinker -----------------------------------------------------------------------
    @torch.no_grad()
    def run_thinker(self, p: PreparedPrompt, opts: GenerationOptions, gen: torch.Generator | None):
        """-> (generated ids, hidden_states[accept] at the prompt positions or None, finish reason)."""
        th = self.model.thinker
        limit = self.cfg.thinker.text.max_position_embeddings
        if limit and len(p.ids) + 1 > limit:
            raise InputError(f"prompt is {len(p.ids)} tokens; the model's context is {limit}")
        ids = torch.tensor([p.ids], device=self.device)
        audio, vis, deepstack = self.encode_media(p)
        x, vmask = th.embed(ids, audio, vis)
        pos, delta = self.positions(p.ids, p)
        accept = self.cfg.talker.accept_hidden_layer if (opts.return_audio and self.cfg.has_audio_output) else None
        cache = DenseKVCache()
        h, hk = th(x, pos.to(self.device)[:, None, :], cache, capture=accept,
                   deepstack=(vmask.flatten().nonzero().squeeze(1), deepstack) if deepstack else None)
        stops = opts.thinker_stops(self.cfg.im_end_token_id)
        out: list[int] = []
        start = len(p.ids) + delta
        while True:
            seen = None
            if opts.thinker.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(out)), dtype=torch.long, device=self.device)
            tok = choose(th.logits(h[0, -1]).float(), opts.thinker, gen, seen=seen)
            out.append(tok)
            if tok in stops:
                return out, (hk[0] if hk is not None else None), "stop"
            if len(out) >= opts.max_tokens or (limit and len(p.ids) + len(out) >= limit):
                return out, (hk[0] if hk is not None else None), "length"
            step_pos = decode_positions(start + len(out) - 1, 1).to(self.device)[:, None, :]
            h, _ = th(th.model.embed_tokens(torch.tensor([[tok]], device=self.device)), step_pos, cache)

    # ---- talker ------------------------------------------------------------------------
    @torch.no_grad()
    def predict_residual_codes(self, h: torch.Tensor, code0: int, opts: GenerationOptions,
                               gen: torch.Generator | None) -> list[int]:
        """Code predictor for one frame: h [H] (talker final-normed) -> codes 1..Q-1."""
        tk = self.model.talker
        cp = tk.code_predictor
        cache = DenseKVCache()
        x = torch.stack([h, tk.model.codec_embedding.weight[code0]])[None]  # [1, 2, H]
        hh = cp.step(x, 0, cache)
        codes: list[int] = []
        for g in range(1, self.cfg.talker.num_code_groups):
            if g > 1:
                hh = cp.step(cp.model.codec_embedding[g - 2].weight[codes[-1]][None, None], g, cache)
            codes.append(choose(cp.lm_head[g - 1](hh[0]).float(), opts.code_predictor, gen))
        return codes

    def suppress_mask(self, ignore_eos: bool = False) -> torch.Tensor:
        """Code0 may be a code or codec EOS: the last 1024 (control) ids are suppressed but EOS."""
        v = self.cfg.talker.text.vocab_size
        mask = torch.zeros(v, dtype=torch.bool, device=self.device)
        mask[v - 1024:] = True
        mask[self.cfg.talker.codec_eos_token_id] = ignore_eos
        return mask

    @torch.no_grad()
    def run_talker(self, p: PreparedPrompt, text_ids: list[int], hk: torch.Tensor, opts: GenerationOptions,
                   gen: torch.Generator | None) -> np.ndarray:
        """-> codes [frames, Q]. No frames when the Thinker wrote a single token."""
        q = self.cfg.talker.num_code_groups
        if len(text_ids) < 2 or opts.max_frames <= 0:
            return np.zeros((0, q), dtype=np.int64)
        tk, ti = self.model.talker, self.talker_inputs
        pre = ti.prefill(p.ids, hk, text_ids[0], opts.speaker_id, opts.talker_instruction_ids)
        user_media = _media_in_spans(p, pre.user_spans, self.cfg)
        pos, delta = self.positions(pre.input_ids, user_media, talker=True)
        cache = DenseKVCache()
        h = tk(pre.embeds[None], pos.to(self.device)[:, None, :], cache)[0, -1]
        eos, suppress = self.cfg.talker.codec_eos_token_id, self.suppress_mask(opts.ignore_eos)
        start = len(pre.input_ids) + delta
        history: list[int] = []
        frames: list[list[int]] = []
        g_count = len(text_ids)
        while True:
            code0 = choose(tk.codec_head(h).float(), opts.talker, gen,
                           seen=torch.tensor(sorted(set(history)), dtype=torch.long, device=self.device),
                           suppress=suppress)
            history.append(code0)
            if code0 == eos:
                break
            frame = [code0] + self.predict_residual_codes(h, code0, opts, gen)
            frames.append(frame)
            if len(frames) >= opts.max_frames:
                break
            s = len(frames) - 1
            nxt = text_ids[s + 1] if s + 1 < g_count else None
            x = tk.frame_embedding(torch.tensor([frame], device=self.device))[0] + ti.frame_text(nxt, s + 1 == g_count - 1)
            step_pos = decode_positions(start + s, 1).to(self.device)[:, None, :]
            h = tk(x[None, None], step_pos, cache)[0, -1]
        return np.asarray(frames, dtype=np.int64).reshape(-1, q)

    @torch.no_grad()
    def vocode(self, codes: np.ndarray) -> np.ndarray:
        if codes.shape[0] == 0:
            return np.zeros(0, dtype=np.float32)
        c = torch.as_tensor(codes.T[None], device=self.device)  # [1, Q, T]
        return self.model.code2wav(c)[0, 0].float().cpu().numpy()

    def generate(self, p: PreparedPrompt, opts: GenerationOptions) -> GenerationOutput:
        gen_thinker, gen_talker = request_generators(opts.seed, self.device)
        want_audio = opts.return_audio and self.cfg.has_audio_output
        text_ids, hk, reason = self.run_thinker(p, opts, gen_thinker)
        q = self.cfg.talker.num_code_groups if self.cfg.has_audio_output else 0
        codes = self.run_talker(p, text_ids, hk, opts, gen_talker) if want_audio else np.zeros((0, q), dtype=np.int64)
        audio = self.vocode(codes) if want_audio else np.zeros(0, dtype=np.float32)
        return GenerationOutput(text_ids, codes, audio, self.SAMPLE_RATE, reason)


def _media_in_spans(p: PreparedPrompt, spans: list[tuple[int, int]], cfg) -> PreparedPrompt:
    """The media whose placeholder runs start inside the kept user spans (for Talker positions)."""
    th = cfg.thinker
    kinds = {th.audio_token_id: "audio", th.image_token_id: "visual", th.video_token_id: "visual"}
    starts: dict[str, list[int]] = {"audio": [], "visual": []}
    for i, t in enumerate(p.ids):
        if t in kinds and (i == 0 or p.ids[i - 1] != t):
            starts[kinds[t]].append(i)

    def kept(i: int) -> bool:
        return any(s <= i < e for s, e in spans)

    return PreparedPrompt(
        ids=[],
        audio_token_counts=[c for c, i in zip(p.audio_token_counts, starts["audio"]) if kept(i)],
        visual=[v for v, i in zip(p.visual, starts["visual"]) if kept(i)],
    )
