"""A DFlash draft's config: z-lab's layout, a Qwen3 decoder config plus `block_size`,
`num_target_layers` and `dflash_config: {mask_token_id, target_layer_ids}` (reference: the `dflash`
package's `DFlashDraftModel`). `check` refuses a draft that does not fit a Thinker, in one line
naming the field and both values."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omnivox.speculative.fit import DraftMismatch, check_layer_ids, check_same, config_fields, read_config


def _get(d: dict, name: str, default=None):
    """z-lab's lookup: `dflash_config` first, then the top level."""
    return (d.get("dflash_config") or {}).get(name, d.get(name, default))


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @classmethod
    def from_hf(cls, d: dict) -> "DFlashConfig":
        """config.json's dict -> the config. Raises DraftMismatch for what omnivox does not run
        (sliding or causal draft layers, biases, RoPE scaling, another activation, DFlash2's
        convolutions) and for missing fields."""
        arch = d.get("architectures") or ["DFlashDraftModel"]
        if arch != ["DFlashDraftModel"]:
            raise DraftMismatch(f"draft architectures: omnivox runs ['DFlashDraftModel'], the draft has {arch}")
        if any(t != "full_attention" for t in d.get("layer_types") or []) or d.get("is_causal"):
            raise DraftMismatch("draft layer_types: omnivox runs full_attention (non-causal) layers only, the draft "
                                f"has {d.get('layer_types')} (is_causal {d.get('is_causal')})")
        for name, want in (("attention_bias", False), ("hidden_act", "silu")):
            if d.get(name, want) != want:
                raise DraftMismatch(f"draft {name}: omnivox runs {want!r}, the draft has {d.get(name)!r}")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise DraftMismatch(f"draft rope_type: omnivox runs 'default', the draft has {rope.get('rope_type')!r}")
        ids = _get(d, "target_layer_ids")
        if ids is None:
            raise DraftMismatch("draft dflash_config.target_layer_ids: omnivox needs them explicit, the draft has none")
        with config_fields():
            heads = int(d["num_attention_heads"])
            return cls(hidden_size=int(d["hidden_size"]), num_hidden_layers=int(d["num_hidden_layers"]),
                       num_attention_heads=heads, num_key_value_heads=int(d.get("num_key_value_heads", heads)),
                       head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
                       intermediate_size=int(d["intermediate_size"]), vocab_size=int(d["vocab_size"]),
                       rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                       rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
                       block_size=int(_get(d, "block_size", 16)), num_target_layers=int(d["num_target_layers"]),
                       mask_token_id=int(_get(d, "mask_token_id")), target_layer_ids=tuple(int(i) for i in ids),
                       input_embedding_scale=float(_get(d, "input_embedding_scale", 1.0)),
                       output_multiplier=float(_get(d, "output_multiplier", 1.0)),
                       final_logit_softcapping=_get(d, "final_logit_softcapping"))

    @classmethod
    def load(cls, folder: Path) -> "DFlashConfig":
        return cls.from_hf(read_config(folder))

    def check(self, thinker) -> None:
        """Refuse a draft that does not fit the Thinker's text config `thinker` (a DecoderConfig):
        one line naming the field, the draft's value and the Thinker's."""
        check_same(("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size"), self, thinker)
        layers = thinker.num_hidden_layers
        if self.num_target_layers != layers:
            raise DraftMismatch(f"draft num_target_layers is {self.num_target_layers} but the Thinker has {layers} "
                                "layers")
        check_layer_ids("dflash_config.target_layer_ids", self.target_layer_ids, layers)
        if not 0 <= self.mask_token_id < thinker.vocab_size:
            raise DraftMismatch(f"draft dflash_config.mask_token_id is {self.mask_token_id} but the Thinker's "
                                f"vocab_size is {thinker.vocab_size}")
        if self.block_size < 2:
            raise DraftMismatch(f"draft block_size is {self.block_size}, below 2 (a block drafts block_size - 1 ids)")
