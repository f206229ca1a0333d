"""One walk over the structured values a step passes around (a step's inputs and outputs, its
forward metadata): dataclasses, lists, tuples and dicts nested, with tensors at the leaves."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """A copy of `obj`'s structure with `fn` applied to every tensor in it; other values as they are."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj)})
    return obj
