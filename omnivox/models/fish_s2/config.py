"""Frozen configs for S2 Pro: the LLM from `config.json`, the codec from `codec.pth` shapes.

`FishConfig.from_hf` reads the official nested `fish_qwen3_omni` config (and the flat
`dual_ar` layout of S1-mini). `CodecConfig.from_state_dict` derives every size the tensor
shapes can tell; head_dim, windows, RoPE base and eps come from the spec's fixed values,
optionally overridden by a `codec_config.json` next to `codec.pth`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Mapping

from omnivox.errors import CheckpointError


@dataclass(frozen=True)
class ARConfig:
    """One decoder stack (the slow AR or the fast AR)."""

    vocab_size: int
    n_layer: int
    dim: int
    n_head: int
    n_local_heads: int
    head_dim: int
    intermediate_size: int
    rope_base: float = 1e6
    norm_eps: float = 1e-6
    max_seq_len: int = 32768
    qk_norm: bool = False
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> "ARConfig":
        try:
            return cls(vocab_size=int(d["vocab_size"]), n_layer=int(d["n_layer"]), dim=int(d["dim"]),
                       n_head=int(d["n_head"]), n_local_heads=int(d.get("n_local_heads", d["n_head"])),
                       head_dim=int(d.get("head_dim", d["dim"] // d["n_head"])),
                       intermediate_size=int(d["intermediate_size"]),
                       rope_base=float(d.get("rope_base", 1e6)), norm_eps=float(d.get("norm_eps", 1e-6)),
                       max_seq_len=int(d.get("max_seq_len", 32768)),
                       qk_norm=bool(d.get("attention_qk_norm", False)),
                       tie_word_embeddings=bool(d.get("tie_word_embeddings", False)))
        except KeyError as e:
            raise CheckpointError(f"config.json: {where} lacks key {e.args[0]!r}") from None


OUTPUT_RESERVE = 2048  # positions fish-speech keeps free for the reply


@dataclass(frozen=True)
class FishConfig:
    """Dual-AR hyper-parameters (spec 4.1-4.3)."""

    text: ARConfig
    fast: ARConfig
    codebook_size: int  # fast-AR vocabulary = semantic codebook size (4096)
    num_codebooks: int  # 1 semantic + residual codebooks (10)
    eos_id: int  # <|im_end|>
    pad_id: int
    semantic_begin: int
    semantic_end: int  # inclusive
    scale_codebook_embeddings: bool = True
    norm_fastlayer_input: bool = True

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> "FishConfig":
        """Official `fish_qwen3_omni` (nested) or S1-mini `dual_ar` (flat) config.json."""
        kind = d.get("model_type")
        if kind == "fish_qwen3_omni":
            if "text_config" not in d or "audio_decoder_config" not in d:
                raise CheckpointError("config.json: fish_qwen3_omni needs text_config and audio_decoder_config")
            text = ARConfig.from_dict(d["text_config"], "text_config")
            audio = d["audio_decoder_config"]
            fast = ARConfig.from_dict(audio, "audio_decoder_config")
            scale, norm_fast = True, True  # hard-coded by fish-speech for this model type
            codebook_size, n_cb = int(audio["vocab_size"]), int(audio.get("num_codebooks", 10))
        elif kind == "dual_ar":
            text = ARConfig.from_dict(d, "config")
            fast_keys = {k[len("fast_"):]: v for k, v in d.items() if k.startswith("fast_")}
            fast = ARConfig.from_dict({**{"vocab_size": d["codebook_size"], "n_layer": d.get("n_fast_layer", 4),
                                          "max_seq_len": d["num_codebooks"] + 1}, **d, **fast_keys},
                                      "config (fast_*)")
            fast = replace(fast, vocab_size=int(d["codebook_size"]), n_layer=int(d.get("n_fast_layer", 4)),
                           max_seq_len=int(d["num_codebooks"]) + 1, tie_word_embeddings=False)
            scale = bool(d.get("scale_codebook_embeddings", False))
            norm_fast = bool(d.get("norm_fastlayer_input", False))
            codebook_size, n_cb = int(d["codebook_size"]), int(d["num_codebooks"])
        else:
            raise CheckpointError(f"config.json: model_type {kind!r} is not a Fish S2 model "
                                  "(expected fish_qwen3_omni or dual_ar)")
        try:
            begin, end = int(d["semantic_start_token_id"]), int(d["semantic_end_token_id"])
            eos = int(d["eos_token_id"])
        except KeyError as e:
            raise CheckpointError(f"config.json: missing {e.args[0]!r}") from None
        cfg = cls(text=text, fast=fast, codebook_size=codebook_size, num_codebooks=n_cb, eos_id=eos,
                  pad_id=int(d.get("pad_token_id", eos)), semantic_begin=begin, semantic_end=end,
                  scale_codebook_embeddings=scale, norm_fastlayer_input=norm_fast)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.semantic_end - self.semantic_begin + 1 != self.codebook_size:
            raise CheckpointError(f"config.json: semantic ids {self.semantic_begin}..{self.semantic_end} "
                                  f"do not span codebook_size={self.codebook_size}")
        if self.semantic_begin <= self.eos_id <= self.semantic_end:
            raise CheckpointError("config.json: eos_token_id lies inside the semantic id range")
        if self.semantic_end >= self.text.vocab_size:
            raise CheckpointError("config.json: semantic ids exceed the text vocab_size")
        if self.fast.dim != self.text.dim:
            raise CheckpointError("config.json: fast dim != text dim needs a project_in layer (unsupported)")
        if self.text.head_dim % 2 or self.fast.head_dim % 2:
            raise CheckpointError("config.json: head_dim must be even for interleaved RoPE")

    @property
    def num_rows(self) -> int:
        """Rows of a prompt matrix: token id + one row per codebook (11)."""
        return self.num_codebooks + 1

    @property
    def max_prompt_len(self) -> int:
        """fish-speech refuses prompts longer than max_seq_len - 2048 (the reserve halved for tiny configs)."""
        return self.text.max_seq_len - min(OUTPUT_RESERVE, self.text.max_seq_len // 2)

    def frame_budget(self, prompt_len: int, max_frames: int) -> int:
        """Frames a request may emit: max_frames (0 = no limit), clipped to the context left."""
        room = self.text.max_seq_len - prompt_len
        return room if max_frames <= 0 else min(max_frames, room)

    def to_hf(self) -> dict[str, Any]:
        """The official nested layout (used by the tiny checkpoint writer)."""
        def ar(c: ARConfig, model_type: str) -> dict[str, Any]:
            return {"model_type": model_type, "vocab_size": c.vocab_size, "n_layer": c.n_layer, "dim": c.dim,
                    "n_head": c.n_head, "n_local_heads": c.n_local_heads, "head_dim": c.head_dim,
                    "intermediate_size": c.intermediate_size, "rope_base": c.rope_base, "norm_eps": c.norm_eps,
                    "max_seq_len": c.max_seq_len, "tie_word_embeddings": c.tie_word_embeddings,
                    "attention_qkv_bias": False, "attention_o_bias": False, "attention_qk_norm": c.qk_norm}
        audio = {**ar(self.fast, "fish_qwen3_audio_decoder"), "num_codebooks": self.num_codebooks,
                 "text_dim": self.text.dim}
        return {"model_type": "fish_qwen3_omni", "dtype": "float32", "eos_token_id": self.eos_id,
                "pad_token_id": self.pad_id, "semantic_start_token_id": self.semantic_begin,
                "semantic_end_token_id": self.semantic_end, "text_config": ar(self.text, "fish_qwen3"),
                "audio_decoder_config": audio}


@dataclass(frozen=True)
class CodecTransformerConfig:
    n_layer: int
    dim: int
    n_head: int
    head_dim: int
    intermediate_size: int
    window: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-5


@dataclass(frozen=True)
class CodecConfig:
    """The modified causal DAC (spec 12.1). Sizes come from tensor shapes."""

    sample_rate: int
    encoder_dim: int
    encoder_rates: tuple[int, ...]
    decoder_dim: int
    decoder_rates: tuple[int, ...]
    codebook_dim: int
    semantic_codebook_size: int
    codebook_size: int  # residual codebooks
    n_residual: int
    downsample_factor: tuple[int, ...]
    encoder_transformer: CodecTransformerConfig
    pre_module: CodecTransformerConfig
    post_module: CodecTransformerConfig

    @property
    def latent_dim(self) -> int:
        return self.encoder_dim * 2 ** len(self.encoder_rates)

    @property
    def num_codebooks(self) -> int:
        return 1 + self.n_residual

    @property
    def hop_length(self) -> int:
        """Samples per codec frame (2048)."""
        prod = 1
        for r in (*self.encoder_rates, *self.downsample_factor):
            prod *= r
        return prod

    @classmethod
    def from_state_dict(cls, shapes: Mapping[str, tuple[int, ...]],
                        overrides: Mapping[str, Any] | None = None) -> "CodecConfig":
        """Derive sizes from folded key -> shape; `overrides` is codec_config.json's content."""
        o = dict(overrides or {})
        try:
            return _codec_from_shapes(shapes, o)
        except KeyError as e:
            raise CheckpointError(f"codec.pth: missing tensor {e.args[0]!r}") from None


_TF_DEFAULTS = {"encoder_transformer": {"head_dim": 64, "window": 512},
                "pre_module": {"head_dim": 64, "window": 128},
                "post_module": {"head_dim": 64, "window": 128}}


def _count(shapes: Mapping[str, Any], pattern: str) -> int:
    rx = re.compile(pattern)
    return len({m.group(1) for k in shapes if (m := rx.match(k))})


def _transformer(shapes, prefix: str, name: str, o: Mapping[str, Any]) -> CodecTransformerConfig:
    dim = shapes[f"{prefix}.norm.weight"][0]
    ffn = shapes[f"{prefix}.layers.0.feed_forward.w1.weight"][0]
    d = {**_TF_DEFAULTS[name], **o.get(name, {})}
    head_dim = int(d["head_dim"])
    return CodecTransformerConfig(n_layer=_count(shapes, rf"{re.escape(prefix)}\.layers\.(\d+)\."), dim=dim,
                                  n_head=dim // head_dim, head_dim=head_dim, intermediate_size=ffn,
                                  window=int(d["window"]), rope_base=float(d.get("rope_base", 10000.0)),
                                  norm_eps=float(d.get("norm_eps", 1e-5)))


def _codec_from_shapes(shapes, o) -> CodecConfig:
    n_enc = _count(shapes, r"encoder\.block\.(\d+)\.block\.4\.conv\.weight")
    enc_rates = tuple(shapes[f"encoder.block.{b}.block.4.conv.weight"][2] // 2 for b in range(1, n_enc + 1))
    n_dec = _count(shapes, r"decoder\.model\.(\d+)\.block\.1\.conv\.weight")
    dec_rates = tuple(shapes[f"decoder.model.{i}.block.1.conv.weight"][2] // 2 for i in range(1, n_dec + 1))
    n_down = _count(shapes, r"quantizer\.downsample\.(\d+)\.0\.conv\.weight")
    down = tuple(shapes[f"quantizer.downsample.{i}.0.conv.weight"][2] for i in range(n_down))
    sem = "quantizer.semantic_quantizer.quantizers.0"
    last = f"encoder.block.{n_enc}.block.5"
    return CodecConfig(
        sample_rate=int(o.get("sample_rate", 44100)),
        encoder_dim=shapes["encoder.block.0.conv.weight"][0], encoder_rates=enc_rates,
        decoder_dim=shapes["decoder.model.0.conv.weight"][0], decoder_rates=dec_rates,
        codebook_dim=shapes[f"{sem}.codebook.weight"][1],
        semantic_codebook_size=shapes[f"{sem}.codebook.weight"][0],
        codebook_size=shapes["quantizer.quantizer.quantizers.0.codebook.weight"][0],
        n_residual=_count(shapes, r"quantizer\.quantizer\.quantizers\.(\d+)\.codebook"),
        downsample_factor=down,
        encoder_transformer=_transformer(shapes, last, "encoder_transformer", o),
        pre_module=_transformer(shapes, "quantizer.pre_module", "pre_module", o),
        post_module=_transformer(shapes, "quantizer.post_module", "post_module", o))


def codec_config_to_json(cfg: CodecConfig) -> dict[str, Any]:
    """What shapes cannot tell, in the codec_config.json override format."""
    def tf(c: CodecTransformerConfig) -> dict[str, Any]:
        return {"head_dim": c.head_dim, "window": c.window, "rope_base": c.rope_base, "norm_eps": c.norm_eps}
    return {"sample_rate": cfg.sample_rate, "encoder_transformer": tf(cfg.encoder_transformer),
            "pre_module": tf(cfg.pre_module), "post_module": tf(cfg.post_module)}
