"""Loading Mimi from safetensors under moshi's own state-dict names (Kyutai's released `mimi` file).

Our modules keep moshi's names except for two layouts:
- a conv is one level shallower: moshi's `P.conv.conv.w` (StreamingConv1d > NormConv1d > Conv1d)
  is our `P.conv.w`, and `P.convtr.convtr.w` is our transposed conv's `P.conv.w`;
- each RVQ stacks its used codebooks in `codebooks` [levels, bins, dim], each level moshi's
  `embedding_sum / cluster_usage.clamp(min=1e-5)` (EuclideanCodebook.embedding), in fp32.
Codebooks past the ones used (the release has 32, Moshi uses 8) and `_initialized` are read over.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from omnivox.errors import CheckpointError
from omnivox.layers.streaming_conv import CausalConv1d, CausalConvTranspose1d
from omnivox.models.moshi.mimi import RVQ, Mimi
from omnivox.models.moshi.mimi_config import MimiConfig

EPSILON = 1e-5  # EuclideanCodebook's clamp of cluster_usage
_CODEBOOK = re.compile(r"^(quantizer\.rvq_\w+)\.vq\.layers\.(\d+)\._codebook\.(\w+)$")


def checkpoint_names(model: Mimi) -> dict[str, str]:
    """Our state-dict name -> moshi's, for every tensor but the RVQ codebooks."""
    renamed = {}
    for path, m in model.named_modules():
        if isinstance(m, (CausalConv1d, CausalConvTranspose1d)):
            inner = "conv.conv" if isinstance(m, CausalConv1d) else "convtr.convtr"
            for p, _ in m.conv.named_parameters():
                renamed[f"{path}.conv.{p}"] = f"{path}.{inner}.{p}"
    return {k: renamed.get(k, k) for k in model.state_dict()
            if not k.endswith(".codebooks")}


def load_mimi(path: str | Path, cfg: MimiConfig | None = None, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> Mimi:
    """Mimi from moshi's safetensors; a missing, mis-shaped or unknown tensor is one CheckpointError line."""
    cfg, path = cfg or MimiConfig(), Path(path)
    with torch.device("meta"):
        model = Mimi(cfg)
    names = checkpoint_names(model)
    shapes = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    where = path.name
    if not path.is_file():
        raise CheckpointError(f"{path} not found (Mimi's weights)")
    state: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        for ours, theirs in names.items():
            if theirs not in keys:
                raise CheckpointError(f"{where}: missing tensor {theirs} (a Mimi of this config needs it)")
            t = f.get_tensor(theirs)
            _check_shape(where, theirs, tuple(t.shape), shapes[ours])
            state[ours] = t.to(device=device, dtype=dtype)
        used = set(names.values())
        for prefix, rvq in (("quantizer.rvq_first", model.quantizer.rvq_first),
                            ("quantizer.rvq_rest", model.quantizer.rvq_rest)):
            state[f"{prefix}.codebooks"] = _codebooks(f, keys, where, prefix, rvq).to(device=device, dtype=dtype)
        for key in sorted(keys - used):
            m = _CODEBOOK.match(key)
            if m is None or not _known_codebook_key(cfg, m):
                raise CheckpointError(f"{where}: unexpected tensor {key} (not part of a Mimi of this config)")
    model.load_state_dict(state, assign=True)
    return model.eval()


def _check_shape(where: str, name: str, got: tuple, want: tuple) -> None:
    if got != want:
        raise CheckpointError(f"{where}: {name} has shape {list(got)}, the config expects {list(want)}")


def _codebooks(f, keys: set[str], where: str, prefix: str, rvq: RVQ) -> torch.Tensor:
    """[levels, bins, dim] fp32: level i = embedding_sum / clamp(cluster_usage, 1e-5)."""
    levels, bins, dim = rvq.codebooks.shape
    tables = []
    for i in range(levels):
        base = f"{prefix}.vq.layers.{i}._codebook"
        for part, want in (("embedding_sum", (bins, dim)), ("cluster_usage", (bins,))):
            if f"{base}.{part}" not in keys:
                raise CheckpointError(f"{where}: missing tensor {base}.{part} (a Mimi of this config needs it)")
            _check_shape(where, f"{base}.{part}", tuple(f.get_slice(f"{base}.{part}").get_shape()), want)
        total = f.get_tensor(f"{base}.embedding_sum").float()
        usage = f.get_tensor(f"{base}.cluster_usage").float()
        tables.append(total / usage.clamp(min=EPSILON)[:, None])
    return torch.stack(tables)


def _known_codebook_key(cfg: MimiConfig, m: re.Match) -> bool:
    """A codebook tensor of the checkpoint's quantizer that this model does not use, or `_initialized`."""
    prefix, level, part = m.group(1), int(m.group(2)), m.group(3)
    q = cfg.quantizer
    levels = q.n_q_semantic if prefix == "quantizer.rvq_first" else q.n_q - q.n_q_semantic
    return level < levels and part in ("embedding_sum", "cluster_usage", "_initialized")
