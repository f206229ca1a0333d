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


def _triton(device: torch.device) -> AttentionBackend:
    from omnivox.attention.triton_paged import TritonPagedAttention, triton_available
    if not triton_available():
        raise ValueError("attention backend 'triton_paged' needs triton (and a CUDA device, or TRITON_INTERPRET=1)")
    return TritonPagedAttention()


# name -> factory(device)
BACKENDS: dict[str, Callable[[torch.device], AttentionBackend]] = {
    "torch_ref": lambda device: TorchPagedAttention(),
    "per_sequence": lambda device: PerSequenceAttention(),
    "triton_paged": _triton,
}


def default_backend(device: torch.device | str) -> str:
    """`triton_paged` on CUDA when triton imports, else `torch_ref`."""
    if torch.device(device).type == "cuda":
        from omnivox.attention.triton_paged import triton_available
        if triton_available():
            return "triton_paged"
    return "torch_ref"


def make_backend(name: str | None, device: torch.device | str) -> AttentionBackend:
    """The backend called `name` (None or "auto": the default for `device`)."""
    device = torch.device(device)
    name = default_backend(device) if name in (None, "auto") else name
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
    return BACKENDS[name](device)
