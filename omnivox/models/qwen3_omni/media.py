"""A prompt's media through the encoders, and its 3-D positions: shared by the engine's stages
and the reference loop, so both compute them the same way."""
from __future__ import annotations

import torch

from omnivox.engine.placement import hand_over
from omnivox.models.qwen3_omni.config import Qwen3OmniConfig
from omnivox.models.qwen3_omni.model import Qwen3OmniModel
from omnivox.models.qwen3_omni.positions import rope_index_for, talker_rope_index_for
from omnivox.models.qwen3_omni.types import PreparedPrompt


def encode_media(model: Qwen3OmniModel, p: PreparedPrompt) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                                  list[torch.Tensor]]:
    """(audio features [N_audio, H], visual features [N_visual, H], deepstack levels) of one
    request. NOTE: one request per call: the reference encoders' output depends on what else
    shares the call."""
    enc, dev, dtype = model.device_of("encoder"), model.device_of("thinker"), model.thinker.lm_head.weight.dtype
    audio = vis = None
    deepstack: list[torch.Tensor] = []
    if p.audio_features:
        feats = [f.to(enc, dtype) for f in p.audio_features]
        audio = hand_over(lambda: model.thinker.audio_tower(feats, window_chunks=p.audio_window_chunks), dev)
    if p.visual:
        pix = torch.cat([v.pixel_values for v in p.visual]).to(enc, dtype)
        vis, levels = model.thinker.visual(pix, [v.grid for v in p.visual])
        vis = hand_over(lambda: vis, dev)
        deepstack = [hand_over(lambda t=t: t, dev) for t in levels]
    return audio, vis, deepstack


def positions(cfg: Qwen3OmniConfig, ids: list[int], p: PreparedPrompt, talker: bool = False) -> tuple[torch.Tensor, float]:
    """(M-RoPE positions [3, len(ids)], the decode offset) of the Thinker's (or the Talker's) prompt."""
    images = [v.grid for v in p.visual if v.kind == "image"]
    videos = [v for v in p.visual if v.kind == "video"]
    media = dict(image_grids=images, video_grids=[v.grid for v in videos],
                 second_per_grids=[v.second_per_grid for v in videos], audio_token_counts=p.audio_token_counts)
    if talker:
        return talker_rope_index_for(cfg.thinker, cfg.talker, ids, **media)
    return rope_index_for(cfg.thinker, ids, **media)


def media_in_spans(p: PreparedPrompt, spans: list[tuple[int, int]], cfg: Qwen3OmniConfig) -> PreparedPrompt:
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


def reply_suppressed_ids(cfg: Qwen3OmniConfig, special_ids: frozenset[int] | set[int] = frozenset(),
                         ends: tuple[int, ...] = ()) -> list[int]:
    """Ids the Thinker never writes into a reply: the control ids the config names (turn start,
    media placeholders and markers, the Talker's tts ids) and the tokenizer's added special tokens,
    but the end-of-turn ids (`im_end` and `ends`, the checkpoint's eos ids). A placeholder or turn
    marker in a reply would re-enter the conversation as a control token in the next turn."""
    th = cfg.thinker
    named = {cfg.im_start_token_id, cfg.tts_pad_token_id, cfg.tts_bos_token_id, cfg.tts_eos_token_id,
             th.audio_token_id, th.image_token_id, th.video_token_id, th.audio_start_token_id,
             th.audio_end_token_id, th.vision_start_token_id, th.vision_end_token_id}
    keep = {cfg.im_end_token_id, *ends}
    v = th.text.vocab_size
    return sorted(i for i in (named | set(special_ids)) if i is not None and 0 <= i < v and i not in keep)


def id_mask(ids: list[int], size: int, device) -> torch.Tensor | None:
    """[size] bool, True at `ids`; None when there are none (nothing to suppress)."""
    if not ids:
        return None
    mask = torch.zeros(size, dtype=torch.bool, device=device)
    mask[list(ids)] = True
    return mask


def suppress_mask(cfg: Qwen3OmniConfig, device, ignore_eos: bool = False) -> torch.Tensor:
    """Code0 may be a code or codec EOS: the last 1024 (control) ids are suppressed but EOS."""
    v = cfg.talker.text.vocab_size
    mask = torch.zeros(v, dtype=torch.bool, device=device)
    mask[v - 1024:] = True
    mask[cfg.talker.codec_eos_token_id] = ignore_eos
    return mask
