"""Choosing an attention backend by name; the contract is in `omnivox.attention`."""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from omnivox.attention.metadata import AttentionMetadata
from omnivox.attention.per_sequence import PerSequenceAttention
from omnivox.attention.torch_ref import TorchPagedAttention


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...


# name -> factory(device). Add "triton_paged" here (and make it the CUDA default below).
BACKENDS: dict[str, Callable[[torch.device], AttentionBackend]] = {
    "torch_ref": lambda device: TorchPagedAttention(),
    "per_sequence": lambda device: PerSequenceAttention(),
}


def default_backend(device: torch.device | str) -> str:
    return "torch_ref"  # every device for now; CUDA gets "triton_paged" once it exists


def make_backend(name: str | None, device: torch.device | str) -> AttentionBackend:
    """The backend called `name` (None or "auto": the default for `device`)."""
    device = torch.device(device)
    name = default_backend(device) if name in (None, "auto") else name
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
    return BACKENDS[name](device)
