"""Loading Moshi's LM from a Kyutai checkpoint folder: `config.json` names the safetensors file
(`moshi_name`); tensors carry moshi's own state-dict keys.

Both spellings of the attention projections load: moshi's module names (`in_projs.{i}.weight`,
`out_projs.{i}.weight`) and the fused ones of Kyutai's releases (`in_proj_weight` or
`in_proj.weight`, `out_proj.weight`: the weight sets stacked on dim 0, split here as moshi's
load hook does). The model is built on the meta device and the tensors are assigned, cast to
`dtype`; any missing, unknown or mis-shaped tensor fails with one line naming it.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from omnivox.errors import CheckpointError
from omnivox.models.moshi.config import MoshiConfig
from omnivox.models.moshi.lm import MoshiLM

_FUSED = re.compile(r"^(.*\.self_attn\.)(in_proj_weight|in_proj\.weight|out_proj\.weight)$")


def load_lm(folder: str | Path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
            cfg: MoshiConfig | None = None) -> MoshiLM:
    folder = Path(folder)
    cfg = cfg or MoshiConfig.from_folder(folder)
    path = folder / cfg.files.moshi_name
    if not path.is_file():
        raise CheckpointError(f"{path} not found (config.json's moshi_name)")
    with torch.device("meta"):
        model = MoshiLM(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for key, tensor in _read(path):
        for name, part in _unfuse(key, tensor, expected, path):
            if name not in expected:
                raise CheckpointError(f"{path}: unknown tensor {name!r} for this config")
            if tuple(part.shape) != expected[name]:
                raise CheckpointError(f"{path}: tensor {name!r} has shape {list(part.shape)}, "
                                      f"expected {list(expected[name])} from config.json")
            state[name] = part.to(device=device, dtype=dtype if part.is_floating_point() else part.dtype)
    missing = [k for k in expected if k not in state]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{path}: missing tensor {missing[0]!r}{more}")
    model.load_state_dict(state, assign=True)
    return model.eval()


def _read(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():
                yield k, f.get_tensor(k)
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"{path}: cannot read safetensors ({type(e).__name__}: {e})") from None


def _unfuse(key: str, tensor: torch.Tensor, expected: dict, path: Path) -> list[tuple[str, torch.Tensor]]:
    """A fused attention projection -> its per-weight-set tensors; any other key unchanged."""
    m = _FUSED.match(key)
    if m is None:
        return [(key, tensor)]
    prefix, kind = m.group(1), "in_projs" if m.group(2).startswith("in_proj") else "out_projs"
    sets = sum(1 for k in expected if k.startswith(f"{prefix}{kind}."))
    if sets == 0:
        raise CheckpointError(f"{path}: unknown tensor {key!r} for this config")
    if tensor.dim() != 2 or tensor.shape[0] % sets:
        raise CheckpointError(f"{path}: tensor {key!r} has shape {list(tensor.shape)}, which does not split into "
                              f"{sets} weight set(s)")
    return [(f"{prefix}{kind}.{i}.weight", part) for i, part in enumerate(tensor.view(sets, -1, tensor.shape[1]))]
