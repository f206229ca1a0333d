"""Parameters merged at load time from several checkpoint tensors, checkpoint names kept.

A merged child `<parent>.<merged>.weight` (q||k||v, gate||up, q_norm||k_norm) is the row
concatenation of its parts: each `Part` is a checkpoint tensor `<parent>.<part.name>.weight`
filling `rows`. A part stored as a single row (a per-head norm weight [D]) is broadcast over
its rows. `keep_checkpoint_names(parent)` makes the parent's `state_dict()` list the parts
(views of the merged tensor) and its `load_state_dict()` accept them, so state-dict based
loaders and writers see the official names; `checkpoint_parts(model)` serves loaders that
stream tensors straight into the merged parameter.

NOTE: `state_dict()` parts are views; writing into a broadcast part's view changes only the
first of its rows. Fill a model through `load_state_dict` (or the loaders), not through those views.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Part:
    name: str  # sibling name in the checkpoint, e.g. "q_proj"
    rows: slice  # rows of the merged weight it fills
    shape: tuple[int, ...]  # its on-disk shape

    def broadcast(self) -> bool:
        """True when one stored row fills every row of the slice (per-head norm weights)."""
        return len(self.shape) == 1


def row_parts(sizes: dict[str, int], row_shape: tuple[int, ...], broadcast: bool = False) -> tuple[Part, ...]:
    """Consecutive parts of `sizes[name]` rows each; stored as one row when `broadcast`."""
    parts, start = [], 0
    for name, n in sizes.items():
        parts.append(Part(name, slice(start, start + n), row_shape if broadcast else (n, *row_shape)))
        start += n
    return tuple(parts)


class MergedLinear(nn.Linear):
    """One bias-free Linear whose output rows are several checkpoint Linears, in order."""

    def __init__(self, in_features: int, sizes: dict[str, int]):
        super().__init__(in_features, sum(sizes.values()), bias=False)
        self.parts = row_parts(sizes, (in_features,))


def _merged_children(parent: nn.Module):
    return [(name, m) for name, m in parent.named_children() if getattr(m, "parts", None)]


def merged_tensors(m: nn.Module) -> dict[str, tuple[Part, ...]]:
    """A merged child's tensors (suffix -> its parts): its weight, and a block-FP8 linear's scale
    rows too (`layers.fp8`)."""
    return m.merged_tensors() if hasattr(m, "merged_tensors") else {"weight": m.parts}


def _split_into_parts(parent: nn.Module, state: dict, prefix: str, _meta) -> None:
    for name, m in _merged_children(parent):
        for suffix, parts in merged_tensors(m).items():
            key = f"{prefix}{name}.{suffix}"
            if key not in state:
                continue
            w = state[key]
            pieces = {f"{prefix}{p.name}.{suffix}": (w[p.rows.start] if p.broadcast() else w[p.rows]) for p in parts}
            # NOTE: the state dict is one ordered dict for the whole model: keep the parts where
            # the merged key was, so checkpoint order matches the unmerged modules.
            later = list(state)[list(state).index(key) + 1:]
            tail = [(k, state.pop(k)) for k in later]
            del state[key]
            state.update(pieces)
            state.update(tail)


def _merge_parts(parent: nn.Module, state: dict, prefix: str, _meta, strict, _missing, _unexpected, errors) -> None:
    for name, m in _merged_children(parent):
        for suffix, parts in merged_tensors(m).items():
            keys = [f"{prefix}{p.name}.{suffix}" for p in parts]
            present = [k for k in keys if k in state]
            if not present:
                continue  # already merged (or absent: the usual missing-key error follows)
            if len(present) < len(keys):
                if strict:
                    errors.append(f"{prefix}{name}.{suffix} needs {', '.join(sorted(set(keys) - set(present)))} "
                                  f"as well as {', '.join(present)}")
                continue
            rows = getattr(m, suffix).shape[0]
            pieces = [state.pop(k) for k in keys]
            pieces = [t.expand(p.rows.stop - p.rows.start, *t.shape) if p.broadcast() else t
                      for p, t in zip(parts, pieces)]
            merged = torch.cat(pieces)
            if merged.shape[0] != rows and strict:
                errors.append(f"{prefix}{name}.{suffix}: parts give {merged.shape[0]} rows, {rows} expected")
            state[f"{prefix}{name}.{suffix}"] = merged


def keep_checkpoint_names(parent: nn.Module) -> None:
    """Let `parent`'s state dict show (and accept) the parts of its merged children."""
    parent.register_state_dict_post_hook(_split_into_parts)
    parent.register_load_state_dict_pre_hook(_merge_parts)


def checkpoint_parts(model: nn.Module) -> dict[str, tuple[str, Part]]:
    """On-disk name -> (merged parameter name, part), for every merged parameter in `model`."""
    out = {}
    for path, m in model.named_modules():
        if not getattr(m, "parts", None):
            continue
        parent = path.rsplit(".", 1)[0] + "." if "." in path else ""
        for suffix, parts in merged_tensors(m).items():
            for p in parts:
                out[f"{parent}{p.name}.{suffix}"] = (f"{path}.{suffix}", p)
    return out
