"""Typed Qwen3-Omni configuration read from a checkpoint's `config.json`.

Values always come from the file, never from class defaults (spec section 3.2). Both RoPE
spellings are accepted: `rope_parameters` (transformers v5 `save_pretrained`) and the
released files' `rope_scaling` + top-level `rope_theta`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnivox.errors import CheckpointError


def _req(d: dict, key: str, where: str) -> Any:
    if key not in d:
        raise CheckpointError(f"config.json: missing required field {where}.{key}")
    return d[key]


def _rope(d: dict, where: str) -> tuple[float, tuple[int, ...] | None, bool]:
    """(theta, mrope_section, interleaved) from either spelling."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    theta = params.get("rope_theta", d.get("rope_theta", scaling.get("rope_theta")))
    if theta is None:
        raise CheckpointError(f"config.json: {where} has no rope_theta")
    section = params.get("mrope_section", scaling.get("mrope_section"))
    interleaved = bool(params.get("interleaved", scaling.get("interleaved", scaling.get("mrope_interleaved", False))))
    return float(theta), (tuple(int(x) for x in section) if section else None), interleaved


@dataclass(frozen=True)
class AudioEncoderConfig:
    num_mel_bins: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    d_model: int
    downsample_hidden_size: int
    output_dim: int
    n_window: int
    n_window_infer: int
    max_source_positions: int

    @classmethod
    def from_hf(cls, d: dict) -> "AudioEncoderConfig":
        return cls(**{f: int(_req(d, f, "audio_config")) for f in cls.__dataclass_fields__})


@dataclass(frozen=True)
class VisionEncoderConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, d: dict) -> "VisionEncoderConfig":
        ints = {f: int(d.get(f, 3) if f == "in_channels" else _req(d, f, "vision_config"))
                for f in cls.__dataclass_fields__ if f not in ("deepstack_visual_indexes", "rope_theta")}
        theta = (d.get("rope_parameters") or {}).get("rope_theta", d.get("rope_theta", 10000.0))
        return cls(**ints, deepstack_visual_indexes=tuple(d.get("deepstack_visual_indexes", [])),
                   rope_theta=float(theta))


@dataclass(frozen=True)
class DecoderConfig:
    """A decoder-only transformer: thinker text model, talker, code predictor, Code2Wav."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...] | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    sliding_window: int | None = None
    max_position_embeddings: int = 0

    @classmethod
    def from_hf(cls, d: dict, where: str, moe: bool = False, shared_expert: bool = False) -> "DecoderConfig":
        theta, section, interleaved = _rope(d, where)
        if section is not None and not interleaved:
            raise CheckpointError(f"config.json: {where} M-RoPE must be interleaved (Qwen3-Omni)")
        heads = int(_req(d, "num_attention_heads", where))
        hidden = int(_req(d, "hidden_size", where))
        kw: dict[str, Any] = dict(
            vocab_size=int(d.get("vocab_size", 0)),
            hidden_size=hidden,
            intermediate_size=int(d.get("intermediate_size", 0)),
            num_hidden_layers=int(_req(d, "num_hidden_layers", where)),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads", heads)),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            mrope_section=section,
            sliding_window=d.get("sliding_window"),
            max_position_embeddings=int(d.get("max_position_embeddings") or 0),
        )
        if moe:
            experts = d.get("num_experts", d.get("num_local_experts"))
            if experts is None:
                raise CheckpointError(f"config.json: {where} has neither num_experts nor num_local_experts")
            kw.update(num_experts=int(experts), num_experts_per_tok=int(_req(d, "num_experts_per_tok", where)),
                      moe_intermediate_size=int(_req(d, "moe_intermediate_size", where)),
                      norm_topk_prob=bool(d.get("norm_topk_prob", True)))
            if d.get("mlp_only_layers") or int(d.get("decoder_sparse_step", 1)) != 1:
                raise CheckpointError(f"config.json: {where}: dense layers inside the MoE stack are not supported")
        if shared_expert:
            kw["shared_expert_intermediate_size"] = int(_req(d, "shared_expert_intermediate_size", where))
        return cls(**kw)


@dataclass(frozen=True)
class ThinkerConfig:
    text: DecoderConfig
    audio: AudioEncoderConfig
    vision: VisionEncoderConfig
    audio_token_id: int
    image_token_id: int
    video_token_id: int
    audio_start_token_id: int
    audio_end_token_id: int | None
    vision_start_token_id: int
    vision_end_token_id: int | None
    position_id_per_seconds: int

    @classmethod
    def from_hf(cls, d: dict) -> "ThinkerConfig":
        w = "thinker_config"
        return cls(
            text=DecoderConfig.from_hf(_req(d, "text_config", w), w + ".text_config", moe=True),
            audio=AudioEncoderConfig.from_hf(_req(d, "audio_config", w)),
            vision=VisionEncoderConfig.from_hf(_req(d, "vision_config", w)),
            audio_token_id=int(_req(d, "audio_token_id", w)),
            image_token_id=int(_req(d, "image_token_id", w)),
            video_token_id=int(_req(d, "video_token_id", w)),
            audio_start_token_id=int(_req(d, "audio_start_token_id", w)),
            audio_end_token_id=d.get("audio_end_token_id"),
            vision_start_token_id=int(_req(d, "vision_start_token_id", w)),
            vision_end_token_id=d.get("vision_end_token_id"),
            position_id_per_seconds=int(_req(d, "position_id_per_seconds", w)),
        )


@dataclass(frozen=True)
class TalkerConfig:
    text: DecoderConfig
    code_predictor: DecoderConfig
    num_code_groups: int
    thinker_hidden_size: int
    accept_hidden_layer: int
    codec_pad_id: int
    codec_bos_id: int
    codec_eos_token_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    speaker_id: dict[str, int] = field(hash=False)
    spatial_merge_size: int = 2
    position_id_per_seconds: int = 13

    @classmethod
    def from_hf(cls, d: dict) -> "TalkerConfig":
        w = "talker_config"
        ints = ("num_code_groups", "thinker_hidden_size", "accept_hidden_layer", "codec_pad_id", "codec_bos_id",
                "codec_eos_token_id", "codec_nothink_id", "codec_think_bos_id", "codec_think_eos_id",
                "spatial_merge_size", "position_id_per_seconds")
        return cls(
            text=DecoderConfig.from_hf(_req(d, "text_config", w), w + ".text_config", moe=True, shared_expert=True),
            code_predictor=DecoderConfig.from_hf(_req(d, "code_predictor_config", w), w + ".code_predictor_config"),
            speaker_id={str(k).lower(): int(v) for k, v in (d.get("speaker_id") or {}).items()},
            **{k: int(_req(d, k, w)) for k in ints},
        )


@dataclass(frozen=True)
class Code2WavConfig:
    codebook_size: int
    num_quantizers: int
    decoder_dim: int
    upsample_rates: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]
    transformer: DecoderConfig

    @property
    def total_upsample(self) -> int:
        n = 1
        for r in self.upsample_rates + self.upsampling_ratios:
            n *= r
        return n

    @classmethod
    def from_hf(cls, d: dict) -> "Code2WavConfig":
        w = "code2wav_config"
        t = DecoderConfig.from_hf({**d, "rms_norm_eps": d.get("rms_norm_eps", 1e-5)}, w)
        return cls(codebook_size=int(_req(d, "codebook_size", w)), num_quantizers=int(_req(d, "num_quantizers", w)),
                   decoder_dim=int(_req(d, "decoder_dim", w)),
                   upsample_rates=tuple(int(x) for x in _req(d, "upsample_rates", w)),
                   upsampling_ratios=tuple(int(x) for x in _req(d, "upsampling_ratios", w)), transformer=t)


@dataclass(frozen=True)
class Qwen3OmniConfig:
    thinker: ThinkerConfig
    talker: TalkerConfig | None
    code2wav: Code2WavConfig | None
    im_start_token_id: int
    im_end_token_id: int
    system_token_id: int
    user_token_id: int
    assistant_token_id: int
    tts_pad_token_id: int
    tts_bos_token_id: int
    tts_eos_token_id: int

    @property
    def has_audio_output(self) -> bool:
        return self.talker is not None

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3OmniConfig":
        if d.get("model_type") not in (None, "qwen3_omni_moe"):
            raise CheckpointError(f"config.json: model_type {d.get('model_type')!r} is not qwen3_omni_moe")
        audio_out = bool(d.get("enable_audio_output", True))
        ids = ("im_start_token_id", "im_end_token_id", "system_token_id", "user_token_id", "assistant_token_id",
               "tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id")
        cfg = cls(
            thinker=ThinkerConfig.from_hf(_req(d, "thinker_config", "")),
            talker=TalkerConfig.from_hf(_req(d, "talker_config", "")) if audio_out else None,
            code2wav=Code2WavConfig.from_hf(_req(d, "code2wav_config", "")) if audio_out else None,
            **{k: int(_req(d, k, "")) for k in ids},
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """The constraints transformers never checks (spec section 2.2)."""
        th = self.thinker
        problems = []
        for name, dc in (("thinker", th.text), ("talker", self.talker.text if self.talker else None)):
            if dc is not None and dc.mrope_section is not None and sum(dc.mrope_section) * 2 != dc.head_dim:
                problems.append(f"{name} sum(mrope_section) must equal head_dim/2")
        if th.audio.output_dim != th.text.hidden_size or th.vision.out_hidden_size != th.text.hidden_size:
            problems.append("audio output_dim and vision out_hidden_size must equal the thinker hidden size")
        if any(i >= th.vision.depth for i in th.vision.deepstack_visual_indexes):
            problems.append("deepstack_visual_indexes must be below the vision depth")
        if len(th.vision.deepstack_visual_indexes) > th.text.num_hidden_layers:
            problems.append("more deepstack levels than thinker layers")
        side = int(round(th.vision.num_position_embeddings ** 0.5))
        if side * side != th.vision.num_position_embeddings:
            problems.append("vision num_position_embeddings must be a perfect square")
        if self.talker is not None and self.code2wav is not None:
            tk, c2w = self.talker, self.code2wav
            if tk.accept_hidden_layer > th.text.num_hidden_layers:
                problems.append("talker accept_hidden_layer exceeds the thinker layer count")
            if tk.text.hidden_size != tk.code_predictor.hidden_size:
                problems.append("talker and code predictor hidden sizes differ")
            if tk.thinker_hidden_size != th.text.hidden_size:
                problems.append("talker thinker_hidden_size differs from the thinker hidden size")
            if c2w.num_quantizers != tk.num_code_groups:
                problems.append("code2wav num_quantizers differs from talker num_code_groups")
            if c2w.decoder_dim % (2 ** len(c2w.upsample_rates)):
                problems.append("code2wav decoder_dim must be divisible by 2^len(upsample_rates)")
            if tk.text.vocab_size <= 1024 or not (tk.text.vocab_size - 1024 <= tk.codec_eos_token_id < tk.text.vocab_size):
                problems.append("talker vocab must end with the 1024 control ids that hold codec EOS")
        if problems:
            raise CheckpointError("config.json is inconsistent: " + "; ".join(problems))
