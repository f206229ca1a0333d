"""Kyutai's Moshi checkpoint config: `config.json` = the keyword arguments of moshi's `LMModel`
plus the names of the folder's files (`moshi_name`, `mimi_name`, `tokenizer_name`, optional
`mimi_config_name`) and optional generation defaults (`lm_gen_config`).

Missing LM keys take `LMModel`'s (and `StreamingTransformer`'s) defaults, as moshi's loader does;
file names are never assumed. The depformer inherits every transformer option of the temporal
transformer unless a `depformer_<option>` key overrides it (moshi's rule).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from omnivox.errors import CheckpointError
from omnivox.models.moshi.lm_sampling import MoshiSamplingParams

NORMS = ("layer_norm", "layer_norm_f32", "rms_norm", "rms_norm_f32")
POS_EMBS = ("none", "rope", "sin", "sin_rope")
GATINGS = ("none", "silu", "gelu", "relu", "sigmoid", "tanh", "leaky_relu", "elu", "mish", "softsign", "identity")
# keys moshi's CheckpointInfo pops before building the LM (not LM arguments)
FILE_KEYS = ("moshi_name", "mimi_name", "tokenizer_name", "mimi_config_name")
IGNORED_KEYS = ("model_type", "lm_gen_config", "tts_config", "stt_config", "model_id", "lora_name", "depformer_causal",
                "depformer_context")  # depformer_context: moshi forces the depformer's context to None
# LMModel options this implementation does not run: a truthy value is refused with one line
UNSUPPORTED = ("conditioners", "fuser", "lora", "quantize", "cross_attention", "demux_second_stream",
               "demux_second_text_stream", "depformer_low_rank_embeddings", "norm_emb", "extra_heads_num_heads",
               "gradient_checkpointing")
LM_KEYS = {"delays", "n_q", "dep_q", "card", "text_card", "text_card_out", "dim", "num_heads", "hidden_scale", "norm",
           "bias_proj", "depformer_dim", "depformer_dim_feedforward", "depformer_multi_linear",
           "depformer_weights_per_step", "depformer_weights_per_step_schedule", "depformer_pos_emb",
           "depformer_norm", "existing_text_padding_id", "existing_text_end_padding_id", "extra_heads_dim",
           "context", "causal"}
TRANSFORMER_KEYS = {"num_layers", "layer_scale", "positional_embedding", "max_period", "positional_scale", "gating",
                    "kv_repeat", "num_heads"}


@dataclass(frozen=True)
class TransformerConfig:
    """One streaming transformer stack (the temporal one or the depformer)."""

    dim: int
    num_heads: int
    num_layers: int
    dim_feedforward: tuple[int, ...]  # per weight set (one unless weights per step)
    norm: str
    gating: str
    positional_embedding: str
    max_period: float
    positional_scale: float
    layer_scale: float | None
    kv_repeat: int
    context: int | None  # attention window in steps (None: unbounded)
    weight_sets: int  # 1, or the number of distinct per-step weight sets
    schedule: tuple[int, ...] | None  # per-step weights: step -> weight set; None: one set for every step

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_heads // self.kv_repeat

    @property
    def per_step(self) -> bool:
        return self.schedule is not None

    def weight_index(self, step: int) -> int:
        return 0 if self.schedule is None else self.schedule[step]

    def gating_hidden(self, dim_feedforward: int) -> int:
        """moshi's ActivationGating width: 21*dim/8 when dim_feedforward is 4*dim, else 2/3 of it."""
        return (21 * self.dim) // 8 if dim_feedforward == 4 * self.dim else (2 * dim_feedforward) // 3


@dataclass(frozen=True)
class MoshiFiles:
    moshi_name: str
    mimi_name: str
    tokenizer_name: str
    mimi_config_name: str | None = None


@dataclass(frozen=True)
class MoshiConfig:
    delays: tuple[int, ...]  # per stream: text, the model's dep_q audio streams, the user's
    n_q: int  # audio streams (model + user)
    dep_q: int  # the model's audio streams (the depformer's steps)
    card: int  # audio codebook size
    text_card: int  # text vocabulary (input; text_card is the initial token)
    text_card_out: int
    existing_text_padding_id: int
    existing_text_end_padding_id: int
    bias_proj: bool
    transformer: TransformerConfig
    depformer: TransformerConfig
    depformer_multi_linear: bool
    depformer_norm: str | None
    files: MoshiFiles
    gen: MoshiSamplingParams  # LMGen's defaults, overridden by `lm_gen_config`

    @property
    def num_codebooks(self) -> int:
        return self.n_q + 1

    @property
    def user_q(self) -> int:
        """The user's audio streams a step takes."""
        return self.n_q - self.dep_q

    @property
    def max_delay(self) -> int:
        return max(self.delays)

    @property
    def depformer_in_count(self) -> int:
        """Projections of the temporal output into the depformer (one per codebook, or per weight set)."""
        return max(self.depformer_in_index(cb) for cb in range(self.dep_q)) + 1

    def depformer_in_index(self, cb: int) -> int:
        if not self.depformer_multi_linear:
            return 0
        return cb if self.depformer.schedule is None else self.depformer.schedule[cb]

    def kv_bytes_per_step(self, dtype_bytes: int) -> int:
        """Bytes of the temporal transformer's K and V one frame adds per session (all layers)."""
        t = self.transformer
        return 2 * t.num_layers * t.kv_heads * t.head_dim * dtype_bytes

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], where: str = "config.json") -> "MoshiConfig":
        if not isinstance(raw, Mapping):
            raise CheckpointError(f"{where}: expected a JSON object")
        for key in UNSUPPORTED:
            if raw.get(key):
                raise CheckpointError(f"{where}: {key}={raw[key]!r} is not supported by omnivox's Moshi LM")
        unknown = [k for k in raw if k not in LM_KEYS | TRANSFORMER_KEYS | set(FILE_KEYS) | set(IGNORED_KEYS)
                   | set(UNSUPPORTED) and not (k.startswith("depformer_") and k[10:] in TRANSFORMER_KEYS)]
        if unknown:
            raise CheckpointError(f"{where}: unknown LM key(s) {', '.join(map(repr, sorted(unknown)))}")
        try:
            return _parse(raw, where)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: {e}") from None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "MoshiConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path} not found: point at a Moshi checkpoint folder")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON: {e.msg}") from None
        return cls.from_json(raw, str(path))


def _parse(raw: Mapping[str, Any], where: str) -> MoshiConfig:
    g = raw.get
    n_q, dep_q = int(g("n_q", 8)), int(g("dep_q", 8))
    delays = tuple(int(d) for d in g("delays", [0]))
    if len(delays) != n_q + 1 or min(delays) < 0:
        raise ValueError(f"delays must hold n_q + 1 = {n_q + 1} non-negative ints, got {list(delays)}")
    if dep_q < 1 or dep_q > n_q:
        raise ValueError(f"dep_q must be in [1, n_q], got {dep_q} (an LM without depformer is not supported)")
    if not g("causal", True):
        raise ValueError("causal=false is not supported (a streaming LM is causal)")
    dim, text_card = int(g("dim", 128)), int(g("text_card", 32000))
    norm = g("norm", "layer_norm")
    main_opts = {k: raw[k] for k in TRANSFORMER_KEYS - {"num_heads"} if k in raw}
    main = _stack(dim, int(g("num_heads", 8)), norm, main_opts, [int(float(g("hidden_scale", 4)) * dim)],
                  context=g("context"), weight_sets=1, schedule=None, default_pos="sin")
    dep_opts = dict(main_opts)
    dep_opts.update({k[10:]: v for k, v in raw.items() if k.startswith("depformer_") and k[10:] in TRANSFORMER_KEYS})
    if "depformer_num_heads" not in raw:
        raise ValueError("depformer_num_heads is required (moshi's LMModel needs it)")
    dep_dim = int(g("depformer_dim", 256))
    dff = g("depformer_dim_feedforward")
    dff = [int(g("hidden_scale", 4) * dep_dim)] if dff is None else ([int(x) for x in dff] if isinstance(dff, list) else [int(dff)])
    schedule = g("depformer_weights_per_step_schedule")
    if schedule is not None:
        schedule = tuple(int(s) for s in schedule)
        if len(schedule) != dep_q:
            raise ValueError(f"depformer_weights_per_step_schedule must hold dep_q = {dep_q} entries")
    per_step = bool(g("depformer_weights_per_step", False))
    if per_step and schedule is None:
        schedule = tuple(range(dep_q))
    sets = max(schedule) + 1 if per_step else 1
    if len(dff) == 1:
        dff = dff * sets
    elif len(dff) != sets:
        raise ValueError(f"depformer_dim_feedforward lists {len(dff)} widths for {sets} weight sets")
    dep_opts["positional_embedding"] = g("depformer_pos_emb", "sin")
    dep = _stack(dep_dim, int(raw["depformer_num_heads"]), norm, dep_opts, dff, context=None, weight_sets=sets,
                 schedule=schedule if per_step else None, default_pos="sin")
    if per_step and dep.gating == "none":
        raise ValueError("depformer_weights_per_step needs a gating (moshi's rule)")
    dep_norm = g("depformer_norm")
    if dep_norm is not None and dep_norm not in NORMS:
        raise ValueError(f"depformer_norm must be one of {', '.join(NORMS)}, got {dep_norm!r}")
    gen = raw.get("lm_gen_config") or {}
    return MoshiConfig(
        delays=delays, n_q=n_q, dep_q=dep_q, card=int(g("card", 1024)), text_card=text_card,
        text_card_out=int(g("text_card_out") or text_card),
        existing_text_padding_id=int(g("existing_text_padding_id", 3)),
        existing_text_end_padding_id=int(g("existing_text_end_padding_id", 0)), bias_proj=bool(g("bias_proj", False)),
        transformer=main, depformer=dep, depformer_multi_linear=bool(g("depformer_multi_linear", False)),
        depformer_norm=dep_norm, files=_files(raw, where),
        gen=MoshiSamplingParams(**{k: type(getattr(MoshiSamplingParams, k))(gen[k])
                                   for k in ("temp", "temp_text", "top_k", "top_k_text") if k in gen}))


def _stack(dim: int, heads: int, norm: str, opts: Mapping[str, Any], dff: list[int], *, context, weight_sets: int,
           schedule, default_pos: str) -> TransformerConfig:
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {norm!r}")
    gating = opts.get("gating", "none")
    pos = opts.get("positional_embedding", default_pos)
    if gating not in GATINGS:
        raise ValueError(f"gating must be one of {', '.join(GATINGS)}, got {gating!r}")
    if pos not in POS_EMBS:
        raise ValueError(f"positional embedding must be one of {', '.join(POS_EMBS)}, got {pos!r}")
    kv_repeat = int(opts.get("kv_repeat", 1))
    if dim % heads or heads % kv_repeat:
        raise ValueError(f"dim {dim} must split into {heads} heads, and heads into kv_repeat {kv_repeat} groups")
    scale = opts.get("layer_scale")
    if "num_layers" not in opts:
        raise ValueError("num_layers is required")
    return TransformerConfig(
        dim=dim, num_heads=heads, num_layers=int(opts["num_layers"]), dim_feedforward=tuple(dff),
        norm=norm, gating=gating, positional_embedding=pos, max_period=float(opts.get("max_period", 10_000)),
        positional_scale=float(opts.get("positional_scale", 1.0)), layer_scale=None if scale is None else float(scale),
        kv_repeat=kv_repeat, context=None if context is None else int(context), weight_sets=weight_sets,
        schedule=schedule)


def _files(raw: Mapping[str, Any], where: str) -> MoshiFiles:
    missing = [k for k in FILE_KEYS[:3] if not isinstance(raw.get(k), str)]
    if missing:
        raise CheckpointError(f"{where}: missing file name key(s) {', '.join(missing)}")
    return MoshiFiles(raw["moshi_name"], raw["mimi_name"], raw["tokenizer_name"], raw.get("mimi_config_name"))
