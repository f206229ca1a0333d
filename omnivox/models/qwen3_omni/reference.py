"""The reference loop: one request at a time through the Thinker loop -> the Talker loop (the
code predictor per frame) -> Code2Wav, with dense KV caches and no batching. Equal to
transformers' `generate` under greedy decoding; the engine's tests use it as their oracle
(`generate_reference`; nothing builds it on a load). It calls the same model code, media encoding
and sampler as the engine, never the other way round.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omnivox.errors import InputError
from omnivox.layers.attention import DenseKVCache
from omnivox.models.qwen3_omni.code2wav import SAMPLE_RATE
from omnivox.models.qwen3_omni.model import Qwen3OmniModel
from omnivox.models.qwen3_omni.media import encode_media, id_mask, media_in_spans, positions, suppress_mask
from omnivox.models.qwen3_omni.positions import decode_positions
from omnivox.models.qwen3_omni.talker_prompt import TalkerInputs
from omnivox.models.qwen3_omni.types import GenerationOptions, PreparedPrompt
from omnivox.sampling import noise
from omnivox.sampling.batched import draw_one
from omnivox.serving import ChatParams, Output


@dataclass
class GenerationOutput:
    text_ids: list[int]
    codes: np.ndarray  # [frames, num_code_groups] int64
    audio: np.ndarray  # [samples] float32
    sample_rate: int
    finish_reason: str  # "stop" (end token) or "length"


class ReferenceGenerator:
    """Runs requests one at a time on a loaded model (the reference-equal path)."""

    def __init__(self, model: Qwen3OmniModel, suppressed_ids: list[int] = ()):
        self.model, self.cfg = model, model.cfg
        self.talker_inputs = TalkerInputs(model) if self.cfg.has_audio_output else None
        self.cp_cache = model.talker.code_predictor.new_cache() if self.cfg.has_audio_output else None
        self.device = model.device_of("thinker")
        if self.cfg.has_audio_output:  # the Talker's and Code2Wav's devices (a placement may split them)
            self.talker_device, self.vocoder_device = model.device_of("talker"), model.device_of("vocoder")
        self.dtype = model.thinker.lm_head.weight.dtype
        self.thinker_suppress = id_mask(suppressed_ids, self.cfg.thinker.text.vocab_size, self.device)  # [V] or None

    def encode_media(self, p: PreparedPrompt):
        return encode_media(self.model, p)

    def positions(self, ids: list[int], p: PreparedPrompt, talker: bool = False) -> tuple[torch.Tensor, float]:
        return positions(self.cfg, ids, p, talker)

    # ---- thinker -----------------------------------------------------------------------
    @torch.no_grad()
    def run_thinker(self, p: PreparedPrompt, opts: GenerationOptions, seed: int):
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
        h, hk, _ = th(x, pos.to(self.device)[:, None, :], cache, capture=accept,
                   deepstack=(vmask.flatten().nonzero().squeeze(1), deepstack) if deepstack else None)
        stops = opts.thinker_stops(self.cfg.im_end_token_id)
        out: list[int] = []
        start = len(p.ids) + delta
        while True:
            tok = draw_one(th.logits(h[0, -1]).float(), opts.thinker, seed, noise.THINKER, len(out), seen_ids=out,
                           suppress=self.thinker_suppress)
            out.append(tok)
            if tok in stops:
                return out, (hk[0] if hk is not None else None), "stop"
            if len(out) >= opts.max_tokens or (limit and len(p.ids) + len(out) >= limit):
                return out, (hk[0] if hk is not None else None), "length"
            step_pos = decode_positions(start + len(out) - 1, 1).to(self.device)[:, None, :]
            h, _, _ = th(th.model.embed_tokens(torch.tensor([[tok]], device=self.device)), step_pos, cache)

    # ---- talker ------------------------------------------------------------------------
    @torch.no_grad()
    def predict_residual_codes(self, h: torch.Tensor, code0: int, opts: GenerationOptions, seed: int,
                               frame: int) -> list[int]:
        """Code predictor for frame `frame`: h [H] (talker final-normed) -> codes 1..Q-1."""
        tk = self.model.talker
        cp = tk.code_predictor

        def draw(logits: torch.Tensor, g: int) -> torch.Tensor:
            tok = draw_one(logits[0], opts.code_predictor, seed, noise.code_predictor(g), frame)
            return torch.tensor([tok], device=self.talker_device)

        emb = tk.model.codec_embedding.weight[code0][None]
        return cp.frame(h[None], emb, draw, self.cp_cache)[0].tolist()

    def suppress_mask(self, ignore_eos: bool = False) -> torch.Tensor:
        return suppress_mask(self.cfg, self.talker_device, ignore_eos)

    @torch.no_grad()
    def run_talker(self, p: PreparedPrompt, text_ids: list[int], hk: torch.Tensor, opts: GenerationOptions,
                   seed: int) -> np.ndarray:
        """-> codes [frames, Q]. No frames when the Thinker wrote a single token."""
        q = self.cfg.talker.num_code_groups
        if len(text_ids) < 2 or opts.max_frames <= 0:
            return np.zeros((0, q), dtype=np.int64)
        tk, ti = self.model.talker, self.talker_inputs
        pre = ti.prefill(p.ids, hk, text_ids[0], opts.speaker_id, opts.talker_instruction_ids)
        user_media = media_in_spans(p, pre.user_spans, self.cfg)
        pos, delta = self.positions(pre.input_ids, user_media, talker=True)
        cache = DenseKVCache()
        h = tk(pre.embeds[None], pos.to(self.talker_device)[:, None, :], cache)[0, -1]
        eos, suppress = self.cfg.talker.codec_eos_token_id, self.suppress_mask(opts.ignore_eos)
        start = len(pre.input_ids) + delta
        history: list[int] = []
        frames: list[list[int]] = []
        g_count = len(text_ids)
        while True:
            code0 = draw_one(tk.codec_head(h).float(), opts.talker, seed, noise.TALKER, len(history),
                             seen_ids=history, suppress=suppress)
            history.append(code0)
            if code0 == eos:
                break
            frame = [code0] + self.predict_residual_codes(h, code0, opts, seed, len(frames))
            frames.append(frame)
            if len(frames) >= opts.max_frames:
                break
            s = len(frames) - 1
            nxt = text_ids[s + 1] if s + 1 < g_count else None
            x = tk.frame_embedding(torch.tensor([frame], device=self.talker_device))[0] + ti.frame_text(nxt, s + 1 == g_count - 1)
            step_pos = decode_positions(start + s, 1).to(self.talker_device)[:, None, :]
            h = tk(x[None, None], step_pos, cache)[0, -1]
        return np.asarray(frames, dtype=np.int64).reshape(-1, q)

    @torch.no_grad()
    def vocode(self, codes: np.ndarray) -> np.ndarray:
        if codes.shape[0] == 0:
            return np.zeros(0, dtype=np.float32)
        c = torch.as_tensor(codes.T[None], device=self.vocoder_device)  # [1, Q, T]
        return self.model.code2wav(c)[0, 0].float().cpu().numpy()

    def generate(self, p: PreparedPrompt, opts: GenerationOptions) -> GenerationOutput:
        seed = noise.draw_seed() if opts.seed is None else opts.seed
        want_audio = opts.return_audio and self.cfg.has_audio_output
        text_ids, hk, reason = self.run_thinker(p, opts, seed)
        q = self.cfg.talker.num_code_groups if self.cfg.has_audio_output else 0
        codes = self.run_talker(p, text_ids, hk, opts, seed) if want_audio else np.zeros((0, q), dtype=np.int64)
        audio = self.vocode(codes) if want_audio else np.zeros(0, dtype=np.float32)
        if 0 < opts.max_frames <= codes.shape[0]:
            reason = "length"  # the frame limit cut the audio (the engine's `Request.limit` "audio")
        return GenerationOutput(text_ids, codes, audio, SAMPLE_RATE, reason)


def generate_reference(omni, messages: list[dict] | None = None, *, prompt_ids: list[int] | None = None,
                       audio: list[Any] = (), images: list[Any] = (), videos: list[Any] = (),
                       system: str | None = None, **options) -> Output:
    """One request through the plain sequential path (no engine) on a loaded Qwen3-Omni (`Omni`
    or its served model); keywords as `Omni.generate`'s: the oracle of the tests."""
    if omni.tp is not None:
        raise InputError("the reference path runs in one process; with tensor parallelism use the engine")
    opts = omni.options(ChatParams(**options))
    prompt = omni.build_prompt(messages, prompt_ids=prompt_ids, audio=audio, images=images, videos=videos,
                               system=system)
    omni.check_speakable(prompt, opts)
    out = ReferenceGenerator(omni.model, omni.suppressed_ids).generate(prompt, opts)  # cheap: no weights of its own
    text = omni.tokenizer.decode(out.text_ids) if omni.tokenizer is not None else ""
    return Output(text, out.text_ids, out.codes, out.audio, out.sample_rate, out.finish_reason)
