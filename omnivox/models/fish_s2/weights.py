"""Loading the official `fishaudio/s2-pro` folder (spec 6).

LLM: `model.safetensors.index.json` + shards (or one `model.safetensors`); `text_model.model.*`
is the slow AR, `audio_decoder.codebook_embeddings` joins it, the rest of `audio_decoder.*` is
the fast AR. `wqkv` stays fused (legacy separate wq/wk/wv are concatenated); the head is tied.
`feed_forward.w1`/`w3` and `attention.q_norm`/`k_norm` keep their names in the modules' state
dicts and load into merged parameters (`omnivox.layers.merged`), so they are checked by name here.
Codec: `codec.pth` read with `torch.load(weights_only=True)` only; both weight-norm styles are
folded, stale `freqs_cis` / `causal_mask` buffers dropped, weights kept in fp32.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch
from safetensors import safe_open
from torch import nn

from omnivox.errors import CheckpointError
from omnivox.layers.fp8 import FP8, FP8Config, convert, quantize
from omnivox.models.fish_s2.codec import FishCodec
from omnivox.models.fish_s2.config import CodecConfig, FishConfig
from omnivox.models.fish_s2.fast_ar import FastAR
from omnivox.models.fish_s2.slow_ar import SlowAR

SLOW_PREFIX = "text_model.model."
FAST_PREFIX = "audio_decoder."
STALE_SUFFIXES = ("freqs_cis", "causal_mask")
FP8_LAYERS = ("layers.",)  # both ARs' decoder layers (attention and feed-forward linears) under a quantization config


def read_raw_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found: point at the fishaudio/s2-pro folder")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e.msg}") from None


def read_config(folder: str | Path) -> FishConfig:
    return FishConfig.from_hf(read_raw_config(folder))


def shard_files(folder: str | Path) -> list[Path]:
    """The safetensors files named by the index (or the single `model.safetensors`)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError):
            raise CheckpointError(f"{index} is malformed: expected a 'weight_map' object") from None
        files = [folder / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{folder}: shard(s) listed in the index are missing: {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{folder}: no model.safetensors.index.json or model.safetensors found")


def iter_llm_tensors(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(on-disk name, tensor), read one at a time."""
    for f in shard_files(folder):
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    yield k, h.get_tensor(k)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{f}: cannot read safetensors ({type(e).__name__}: {e})") from None


def read_llm_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    return dict(iter_llm_tensors(folder))


Arrive = Callable[[str, dict, str, torch.Tensor], None]  # (which AR, its state dict, key, tensor)


def _keep(which: str, sd: dict, key: str, t: torch.Tensor) -> None:
    sd[key] = t


def split_llm(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
              arrive: Arrive = _keep) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """On-disk names -> (slow AR state dict, fast AR state dict); fuses legacy wq/wk/wv. Each tensor
    goes in through `arrive` as it comes ("slow" or "fast", the state dict, its key, the tensor: a
    loader quantizes there, so no more than one layer's weights wait in full precision)."""
    slow: dict[str, torch.Tensor] = {}
    fast: dict[str, torch.Tensor] = {}
    legacy: dict[str, dict[str, torch.Tensor]] = {}  # wq/wk/wv waiting for their siblings, by base key
    for name, t in (tensors.items() if isinstance(tensors, Mapping) else tensors):
        if name == FAST_PREFIX + "codebook_embeddings.weight":
            which, key = "slow", "codebook_embeddings.weight"
        elif name.startswith(SLOW_PREFIX):
            which, key = "slow", name[len(SLOW_PREFIX):]
        elif name.startswith(FAST_PREFIX):
            which, key = "fast", name[len(FAST_PREFIX):]
        else:
            raise CheckpointError(f"unexpected LLM tensor {name!r} (expected text_model.model.* or audio_decoder.*)")
        sd = slow if which == "slow" else fast
        part = next((n for n in ("wq", "wk", "wv") if key.endswith(f".attention.{n}.weight")), None)
        if part is None:
            arrive(which, sd, key, t)
            continue
        base = key[: -len(f"{part}.weight")]
        waiting = legacy.setdefault(which + base, {})
        waiting[part] = t
        if len(waiting) == 3:
            del legacy[which + base]
            arrive(which, sd, base + "wqkv.weight", torch.cat([waiting[n] for n in ("wq", "wk", "wv")], dim=0))
    if legacy:
        raise CheckpointError(f"{next(iter(legacy))[4:]}: legacy wq/wk/wv must all be present")
    return slow, fast


def _quantizing(owns: dict[str, Mapping[str, torch.Tensor]], whats: dict[str, str], fp8: FP8Config | None) -> Arrive:
    """`split_llm`'s arrival: a float tensor bound for a float8 parameter is quantized as it comes (its
    scale added beside it); a float8 tensor bound for a float parameter is refused."""
    def arrive(which: str, sd: dict, k: str, t: torch.Tensor) -> None:
        mine = owns[which].get(k)
        if mine is not None and mine.dtype == FP8 and t.dtype != FP8:
            sd[k], sd[k + "_scale_inv"] = quantize(t, fp8.block)
            return
        if mine is not None and t.dtype == FP8 and mine.dtype != FP8:
            why = "config.json has no quantization_config" if fp8 is None else "omnivox keeps this layer unquantized"
            raise CheckpointError(f"{whats[which]}: tensor {k!r} is float8 in the checkpoint, but it loads into a "
                                  f"{str(mine.dtype)[6:]} parameter ({why})")
        sd[k] = t
    return arrive


def _load_into(module: nn.Module, sd: dict[str, torch.Tensor], what: str, dtype, device,
               fp8: FP8Config | None = None) -> None:
    own = module.state_dict()
    expected = set(own.keys())
    missing, unexpected = sorted(expected - sd.keys()), sorted(sd.keys() - expected)
    if missing:
        raise CheckpointError(f"{what}: missing tensor(s) {', '.join(missing[:3])}"
                              f"{' ...' if len(missing) > 3 else ''} ({len(missing)} in all)")
    if unexpected:
        raise CheckpointError(f"{what}: unexpected tensor(s) {', '.join(unexpected[:3])}"
                              f"{' ...' if len(unexpected) > 3 else ''} ({len(unexpected)} in all)")
    for k, t in sd.items():
        if tuple(t.shape) != tuple(own[k].shape):
            blocks = f" (weight_block_size {list(fp8.block)})" if fp8 and k.endswith("_scale_inv") else ""
            raise CheckpointError(f"{what}: tensor {k!r} has shape {tuple(t.shape)}, config expects "
                                  f"{tuple(own[k].shape)}{blocks}")
    # float8 weights and their float32 scales keep their dtypes; the rest loads in `dtype`
    module.load_state_dict({k: t.to(device=device, dtype=own[k].dtype if own[k].dtype == FP8 or k.endswith(
        "_scale_inv") else dtype) for k, t in sd.items()}, strict=True, assign=True)


def load_llm(folder: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
             quantization: str | None = None, fp8_compute: str = "auto") -> tuple[FishConfig, SlowAR, FastAR]:
    """Build both ARs on the meta device and stream the checkpoint in (no second copy). A checkpoint
    with an FP8 `quantization_config`, or `quantization="fp8"` (online, 128x128 blocks), puts both
    ARs' decoder linears in block FP8 (`layers.fp8`)."""
    raw = read_raw_config(folder)
    cfg = FishConfig.from_hf(raw)
    fp8 = FP8Config.resolve(raw.get("quantization_config"), quantization, fp8_compute, devices=(device,))
    with torch.device("meta"):
        slow, fast = SlowAR(cfg), FastAR(cfg)
    if fp8 is not None:
        convert(slow, FP8_LAYERS, fp8, name_prefix=SLOW_PREFIX)
        convert(fast, FP8_LAYERS, fp8, name_prefix=FAST_PREFIX)
    whats = {"slow": "slow AR (text_model.model.*)", "fast": "fast AR (audio_decoder.*)"}
    slow_sd, fast_sd = split_llm(iter_llm_tensors(folder),
                                 _quantizing({"slow": slow.state_dict(), "fast": fast.state_dict()}, whats, fp8))
    _load_into(slow, slow_sd, whats["slow"], dtype, device, fp8)
    _load_into(fast, fast_sd, whats["fast"], dtype, device, fp8)
    slow.reset_buffers()
    fast.reset_buffers()
    return cfg, slow.eval(), fast.eval()


# ---------------------------------------------------------------- codec.pth

def read_codec_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The raw state dict: `state_dict` wrapper unwrapped, `generator.` prefix stripped."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} not found: the S2 codec weights (codec.pth) are required")
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # unpickling errors come in many types
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{path}: not a readable torch state dict ({first})") from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: expected a dict of tensors (optionally under 'state_dict')")
    if any(k.startswith("generator.") for k in obj):
        obj = {k[len("generator."):]: v for k, v in obj.items() if k.startswith("generator.")}
    return obj


def norm_except_dim0(v: torch.Tensor) -> torch.Tensor:
    """||v|| over every axis but 0, shaped to broadcast against v."""
    return v.flatten(1).norm(dim=1).view(-1, *([1] * (v.dim() - 1)))


def fold_weight_norm(sd: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(folded state dict in fp32, ignored stale buffer keys). w = g * v / ||v|| (norm over axes != 0)."""
    styles = ((".parametrizations.weight.original0", ".parametrizations.weight.original1"),
              (".weight_g", ".weight_v"))
    out: dict[str, torch.Tensor] = {}
    ignored: list[str] = []
    for key, t in sd.items():
        if key.endswith(STALE_SUFFIXES):
            ignored.append(key)
            continue
        style = next((s for s in styles if key.endswith(s[0]) or key.endswith(s[1])), None)
        if style is None:
            out[key] = t.float() if t.is_floating_point() and t.dtype != torch.float64 else t
            continue
        if key.endswith(style[1]):
            continue  # handled with its g
        base = key[: -len(style[0])]
        v = sd.get(base + style[1])
        if v is None:
            raise CheckpointError(f"codec.pth: {key} has no matching {base + style[1]}")
        cd = torch.promote_types(v.dtype, torch.float32)
        g, v = t.to(cd), v.to(cd)
        if g.numel() != v.shape[0]:
            raise CheckpointError(f"codec.pth: {key} has {g.numel()} gains for {v.shape[0]} rows")
        out[base + ".weight"] = v * (g.reshape(-1, *([1] * (v.dim() - 1))) / norm_except_dim0(v))
    for key in sd:
        for g_suf, v_suf in styles:
            if key.endswith(v_suf) and key[: -len(v_suf)] + g_suf not in sd:
                raise CheckpointError(f"codec.pth: {key} has no matching gain {key[: -len(v_suf)] + g_suf}")
    return out, ignored


def load_codec(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               config_path: str | Path | None = None) -> FishCodec:
    """codec.pth (+ optional codec_config.json next to it) -> FishCodec in eval mode."""
    path = Path(path)
    folded, _ = fold_weight_norm(read_codec_state(path))
    config_path = Path(config_path) if config_path else path.with_name("codec_config.json")
    overrides = json.loads(config_path.read_text()) if config_path.is_file() else None
    cfg = CodecConfig.from_state_dict({k: tuple(v.shape) for k, v in folded.items()}, overrides)
    with torch.device("meta"):
        codec = FishCodec(cfg)
    _load_into(codec, folded, f"codec ({path.name})", dtype, device)
    codec.reset_buffers()
    return codec.eval()

