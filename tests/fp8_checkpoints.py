"""Block-FP8 copies of a tiny checkpoint folder, as an offline quantizer writes them: each weight a
rule selects becomes float8 + `weight_scale_inv` (and config.json gets a quantization_config), or, for
the reference, the dequantized values of those same float8 weights in float32."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from omnivox.layers.fp8 import dequantize, quantize

QWEN_FP8 = ("thinker.model.layers.", "talker.model.layers.", "talker.code_predictor.model.layers.")
S2_FP8 = ("text_model.model.layers.", "audio_decoder.layers.")


def qwen_rule(name: str) -> bool:
    return name.startswith(QWEN_FP8) and name.endswith("_proj.weight")


def s2_rule(name: str) -> bool:
    return name.startswith(S2_FP8) and name.endswith(("wqkv.weight", "wo.weight", "w1.weight", "w2.weight",
                                                      "w3.weight"))


def write_fp8(src: Path, dst: Path, block: tuple[int, int], rule, dequantized: bool = False,
              not_convert: tuple[str, ...] = ()) -> Path:
    """A copy of folder `src` whose `rule` tensors (minus names holding a `not_convert` entry) are
    block FP8 (`dequantized`: their dequantized float32 values, no quantization_config)."""
    shutil.copytree(src, dst)
    for f in sorted(dst.glob("*.safetensors")):
        out = {}
        for name, t in load_file(str(f)).items():
            if rule(name) and not any(n in name for n in not_convert):
                q, s = quantize(t, block)
                if dequantized:
                    out[name] = dequantize(q, s, block)
                else:
                    out[name], out[name + "_scale_inv"] = q, s
            else:
                out[name] = t
        save_file(out, str(f), metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if index.is_file():  # the scales live in their weights' shards
        doc = json.loads(index.read_text())
        doc["weight_map"].update({k + "_scale_inv": v for k, v in list(doc["weight_map"].items()) if rule(k)})
        index.write_text(json.dumps(doc))
    if not dequantized:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(block), "modules_to_not_convert": list(not_convert)}
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst
