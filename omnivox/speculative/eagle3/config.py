"""An EAGLE-3 head's config, in either layout people train with:

- SafeAILab / SGLang (`architectures: ["LlamaForCausalLMEagle3"]`): a Llama config at the top
  level plus `draft_vocab_size`, optional `target_hidden_size`, `norm_before_residual` and
  `eagle_config.eagle_aux_hidden_state_layer_ids`, which name the layers whose OUTPUT is taken
  (SGLang captures the residual entering layer id + 1); weights `midlayer.*`.
- vLLM's `speculators` (`architectures: ["Eagle3Speculator"]`, `speculators_model_type:
  "eagle3"`): the decoder layer's config nested in `transformer_layer_config` (a Qwen3 one, with
  q/k norms, unless its `model_type` says "llama"), `eagle_aux_hidden_state_layer_ids` at the top
  level indexing transformers' `hidden_states` (id i = the output of layer i - 1, as vLLM
  captures the residual entering layer i); weights `layers.0.*`.

Without ids both peers take [2, N // 2, N - 3] in their own convention, i.e. the outputs of
layers [1, N // 2 - 1, N - 4]; omnivox does the same. `taps` are always layer outputs (the
Thinker's convention, `Drafter.taps`). `check` refuses a head that does not fit a Thinker in one
line naming the field and both values."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from omnivox.kv_cache.pool import KVPool
from omnivox.speculative.fit import DraftMismatch, check_layer_ids, check_same, config_fields, read_config

SGLANG, SPECULATORS = "LlamaForCausalLMEagle3", "Eagle3Speculator"


@dataclass(frozen=True)
class Eagle3Config:
    layout: str  # SGLANG | SPECULATORS
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    layer_ids: tuple[int, ...] | None  # as the checkpoint writes them (None: the peers' default)
    qk_norm: bool = False  # per-head q/k RMSNorm (a Qwen3 decoder layer)
    norm_before_residual: bool = False  # the residual is hidden_norm(hidden), not hidden
    norm_output: bool = False  # speculators' "Eagle 3.1": the next step reads the normed hidden state
    target_hidden_size: int | None = None

    @classmethod
    def from_hf(cls, d: dict) -> "Eagle3Config":
        """config.json's dict -> the config. Raises DraftMismatch naming what omnivox does not run
        (another architecture, several decoder layers, biases, RoPE scaling, norms before `fc`)."""
        arch = d.get("architectures") or []
        if d.get("speculators_model_type") == "eagle3" or arch == [SPECULATORS]:
            layout, layer = SPECULATORS, dict(d.get("transformer_layer_config") or {})
            ids = d.get("eagle_aux_hidden_state_layer_ids")
            qk_norm = layer.get("model_type", "qwen3") == "qwen3"
            for name in ("norm_before_fc", "fc_norm"):
                if d.get(name):
                    raise DraftMismatch(f"draft {name}: omnivox runs heads without it, the draft has {d[name]!r}")
        elif arch in ([SGLANG], ["Eagle3LlamaForCausalLM"]):
            layout, layer = SGLANG, d
            ids, qk_norm = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"), False
        else:
            raise DraftMismatch(f"draft architectures: omnivox runs EAGLE-3 heads ['{SGLANG}'] or ['{SPECULATORS}'], "
                                f"the draft has {arch}")
        if layer.get("num_hidden_layers", 1) != 1:
            raise DraftMismatch(f"draft num_hidden_layers: omnivox runs one-layer EAGLE-3 heads, the draft has "
                                f"{layer.get('num_hidden_layers')}")
        for name, want in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
            if layer.get(name, want) != want:
                raise DraftMismatch(f"draft {name}: omnivox runs {want!r}, the draft has {layer.get(name)!r}")
        rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise DraftMismatch(f"draft rope_type: omnivox runs 'default', the draft has {rope.get('rope_type')!r}")
        with config_fields():
            heads, hidden = int(layer["num_attention_heads"]), int(layer["hidden_size"])
            vocab = int(layer["vocab_size"])
            return cls(layout=layout, hidden_size=hidden, num_attention_heads=heads,
                       num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
                       head_dim=int(layer.get("head_dim") or hidden // heads),
                       intermediate_size=int(layer["intermediate_size"]), vocab_size=vocab,
                       draft_vocab_size=int(d.get("draft_vocab_size") or vocab),
                       rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
                       rope_theta=float(rope.get("rope_theta", layer.get("rope_theta", 10000.0))),
                       layer_ids=None if ids is None else tuple(int(i) for i in ids), qk_norm=qk_norm,
                       norm_before_residual=bool(d.get("norm_before_residual", False)),
                       norm_output=bool(d.get("norm_output", False)),
                       target_hidden_size=d.get("target_hidden_size"))

    @classmethod
    def load(cls, folder: Path) -> "Eagle3Config":
        return cls.from_hf(read_config(folder))

    def taps(self, layers: int) -> tuple[int, ...]:
        """The Thinker layers (of `layers`) whose outputs the head reads, in the Thinker's
        convention (an output of layer i)."""
        if self.layer_ids is None:
            return (1, layers // 2 - 1, layers - 4)
        return self.layer_ids if self.layout == SGLANG else tuple(i - 1 for i in self.layer_ids)

    def ids_field(self) -> str:
        return ("eagle_config.eagle_aux_hidden_state_layer_ids (layer outputs)" if self.layout == SGLANG else
                "eagle_aux_hidden_state_layer_ids - 1 (speculators' ids index hidden_states)")

    def check(self, thinker) -> None:
        """Refuse a head that does not fit the Thinker's text config `thinker` (a DecoderConfig)."""
        check_same(("hidden_size", "vocab_size"), self, thinker)
        if self.target_hidden_size not in (None, thinker.hidden_size):
            raise DraftMismatch(f"draft target_hidden_size is {self.target_hidden_size} but the Thinker's hidden_size "
                                f"is {thinker.hidden_size}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise DraftMismatch(f"draft draft_vocab_size is {self.draft_vocab_size}, not within 1..vocab_size "
                                f"{self.vocab_size}")
        layers = thinker.num_hidden_layers
        field = self.ids_field() if self.layer_ids is not None else "default layer ids [1, N // 2 - 1, N - 4]"
        check_layer_ids(field, self.taps(layers), layers)

    def page_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes per Thinker page of what the head keeps per position: its one layer's K/V and the
        fused target feature (`fc`'s output, H)."""
        feature = block_size * self.hidden_size * torch.empty(0, dtype=dtype).element_size()
        return KVPool.bytes_per_block(1, block_size, self.num_key_value_heads, self.head_dim, dtype) + feature
