"""Mimi's frozen config, read from moshi's own JSON layout (`mimi_config_name` in a checkpoint's
config.json, the dict `moshi.models.loaders.get_mimi` takes), else Kyutai's released values.

Only what inference runs is accepted: causal convs without weight norm, identity skips, the
transformers' LayerNorm + GELU feed-forward + RoPE, the learnt conv resampling; anything else is a
one-line `CheckpointError` naming the key.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from omnivox.errors import CheckpointError

MIMI_NAME = "tokenizer-e351c8d8-checkpoint125.safetensors"  # moshi's default `mimi_name`


@dataclass(frozen=True)
class SeanetConfig:
    channels: int = 1
    dimension: int = 512
    n_filters: int = 64
    n_residual_layers: int = 1
    ratios: tuple[int, ...] = (8, 6, 5, 4)  # decoder order; the encoder runs them reversed
    activation: str = "ELU"
    activation_params: tuple[tuple[str, float], ...] = (("alpha", 1.0),)
    kernel_size: int = 7
    residual_kernel_size: int = 3
    last_kernel_size: int = 3
    dilation_base: int = 2
    compress: int = 2
    pad_mode: str = "constant"

    @property
    def hop_length(self) -> int:
        n = 1
        for r in self.ratios:
            n *= r
        return n


@dataclass(frozen=True)
class QuantizerConfig:
    dimension: int = 256  # codebook vectors
    n_q: int = 32  # codebooks in the checkpoint (1 semantic + acoustic)
    bins: int = 2048  # card
    input_dimension: int = 512
    output_dimension: int = 512
    n_q_semantic: int = 1


@dataclass(frozen=True)
class TransformerConfig:
    d_model: int = 512
    num_heads: int = 8
    num_layers: int = 8
    dim_feedforward: int = 2048
    context: int = 250  # attention window, in encoder steps (2 per frame)
    layer_scale: float | None = 0.01
    max_period: float = 10000.0
    input_dimension: int = 512
    output_dimension: int = 512

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


@dataclass(frozen=True)
class MimiConfig:
    sample_rate: int = 24000
    frame_rate: float = 12.5
    seanet: SeanetConfig = field(default_factory=SeanetConfig)
    quantizer: QuantizerConfig = field(default_factory=QuantizerConfig)
    transformer: TransformerConfig = field(default_factory=TransformerConfig)
    num_codebooks: int = 8  # the codebooks Moshi uses (moshi's `set_num_codebooks`)

    @property
    def frame_size(self) -> int:
        return int(self.sample_rate / self.frame_rate)  # 1920 samples

    @property
    def steps_per_frame(self) -> int:
        """Encoder steps (transformer positions) per frame: the conv resampling's stride."""
        return self.frame_size // self.seanet.hop_length

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], num_codebooks: int = 8, where: str = "mimi config") -> "MimiConfig":
        """moshi's layout: {sample_rate, channels, frame_rate, seanet: {...}, quantizer: {...}, transformer: {...}}."""
        try:
            cfg = cls(sample_rate=int(d["sample_rate"]), frame_rate=float(d["frame_rate"]),
                      seanet=_seanet(d["seanet"], where), quantizer=_quantizer(d["quantizer"]),
                      transformer=_transformer(d["transformer"], where), num_codebooks=int(num_codebooks))
        except KeyError as e:
            raise CheckpointError(f"{where}: missing key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: bad value ({e})") from None
        cfg.validate(where)
        return cfg

    def validate(self, where: str = "mimi config") -> None:
        s, q, t = self.seanet, self.quantizer, self.transformer
        if self.frame_size % s.hop_length or self.steps_per_frame < 1:
            raise CheckpointError(f"{where}: frame of {self.frame_size} samples is not a multiple of the "
                                  f"SEANet hop {s.hop_length}")
        if s.channels != 1:
            raise CheckpointError(f"{where}: seanet channels {s.channels} unsupported (Mimi is mono)")
        if t.d_model % t.num_heads:
            raise CheckpointError(f"{where}: transformer d_model {t.d_model} not divisible by num_heads {t.num_heads}")
        if not q.n_q_semantic < self.num_codebooks <= q.n_q:
            raise CheckpointError(f"{where}: {self.num_codebooks} codebooks used, the quantizer has "
                                  f"{q.n_q_semantic} semantic of {q.n_q}")
        if s.dimension != t.input_dimension or s.dimension != t.output_dimension \
                or s.dimension != q.input_dimension or s.dimension != q.output_dimension:
            raise CheckpointError(f"{where}: the transformers' and quantizer's outer dimensions must equal "
                                  f"seanet.dimension {s.dimension}")


def _require(d: Mapping[str, Any], key: str, allowed: tuple, where: str, default: Any = None) -> None:
    value = d.get(key, default)
    if value not in allowed:
        raise CheckpointError(f"{where}: {key}={value!r} unsupported (expected one of {list(allowed)})")


def _seanet(d: Mapping[str, Any], where: str) -> SeanetConfig:
    where = f"{where} seanet"
    _require(d, "causal", (True,), where, False)
    _require(d, "norm", ("none",), where, "none")
    _require(d, "true_skip", (True,), where, True)
    _require(d, "pad_mode", ("constant", "replicate"), where, "reflect")
    _require(d, "final_activation", (None,), where)
    _require(d, "trim_right_ratio", (1.0,), where, 1.0)
    params = d.get("activation_params") or {"alpha": 1.0}
    if not isinstance(getattr(nn, str(d.get("activation", "ELU")), None), type):
        raise CheckpointError(f"{where}: activation {d.get('activation')!r} is not a torch.nn activation")
    return SeanetConfig(channels=int(d.get("channels", 1)), dimension=int(d["dimension"]),
                        n_filters=int(d["n_filters"]), n_residual_layers=int(d["n_residual_layers"]),
                        ratios=tuple(int(r) for r in d["ratios"]), activation=str(d.get("activation", "ELU")),
                        activation_params=tuple((str(k), float(v)) for k, v in params.items()),
                        kernel_size=int(d["kernel_size"]), residual_kernel_size=int(d["residual_kernel_size"]),
                        last_kernel_size=int(d["last_kernel_size"]), dilation_base=int(d["dilation_base"]),
                        compress=int(d["compress"]), pad_mode=str(d["pad_mode"]))


def _quantizer(d: Mapping[str, Any]) -> QuantizerConfig:
    dim = int(d["dimension"])
    return QuantizerConfig(dimension=dim, n_q=int(d["n_q"]), bins=int(d["bins"]),
                           input_dimension=int(d.get("input_dimension") or dim),
                           output_dimension=int(d.get("output_dimension") or dim),
                           n_q_semantic=int(d.get("n_q_semantic", 1)))


def _transformer(d: Mapping[str, Any], where: str) -> TransformerConfig:
    where = f"{where} transformer"
    _require(d, "causal", (True,), where, False)
    _require(d, "conv_layout", (True,), where, False)
    _require(d, "gating", ("none",), where, "none")
    _require(d, "norm", ("layer_norm",), where, "layer_norm")
    _require(d, "positional_embedding", ("rope",), where, "sin")
    _require(d, "kv_repeat", (1,), where, 1)
    if d.get("context") is None:
        raise CheckpointError(f"{where}: context is required (streaming needs a finite attention window)")
    outputs = list(d.get("output_dimensions") or [d["d_model"]])
    if len(outputs) != 1:
        raise CheckpointError(f"{where}: output_dimensions {outputs} unsupported (Mimi has one output)")
    scale = d.get("layer_scale")
    return TransformerConfig(d_model=int(d["d_model"]), num_heads=int(d["num_heads"]),
                             num_layers=int(d["num_layers"]), dim_feedforward=int(d.get("dim_feedforward", 2048)),
                             context=int(d["context"]), layer_scale=None if scale is None else float(scale),
                             max_period=float(d.get("max_period", 10000)),
                             input_dimension=int(d.get("input_dimension") or d["d_model"]),
                             output_dimension=int(outputs[0]))


def mimi_checkpoint(folder: str | Path) -> tuple[Path, MimiConfig]:
    """(Mimi's safetensors, its config) as moshi's `CheckpointInfo` finds them in a local folder:
    `mimi_name` and `mimi_config_name` from config.json (moshi's defaults when absent), and the
    codebooks the LM uses, max(dep_q, n_q - dep_q) (8 without an LM config)."""
    folder = Path(folder)
    raw: dict[str, Any] = {}
    path = folder / "config.json"
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON: {e.msg}") from None
    weights = folder / str(raw.get("mimi_name", MIMI_NAME))
    if not weights.is_file():
        raise CheckpointError(f"{weights} not found (Mimi's weights, config.json's mimi_name)")
    n_codebooks = max(raw["dep_q"], raw["n_q"] - raw["dep_q"]) if "dep_q" in raw and "n_q" in raw else 8
    name = raw.get("mimi_config_name")
    if name is None:
        return weights, MimiConfig(num_codebooks=n_codebooks)
    cfg_path = folder / str(name)
    try:
        d = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{cfg_path} not found (config.json's mimi_config_name)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON: {e.msg}") from None
    return weights, MimiConfig.from_dict(d, n_codebooks, where=cfg_path.name)
