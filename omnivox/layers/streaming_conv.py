"""Causal 1-D convolutions that run one-shot or incrementally with an explicit carried state.

Every streaming module here follows one contract:

    state = module.init_state(batch, device, dtype)      # a small dataclass, batch-first tensors
    y, skip = module.step(x, state, skip)                # x: [B, C, n] new steps; state is updated

`skip` ([B] long) counts, per row, the leading steps of `x` that are not yet part of the stream.
Only a fresh stream has them: Qwen3-Omni's transposed convs trim one input step of look-ahead,
so their first call emits `stride` samples that the one-shot decode never produces. A causal
conv reads such steps as zeros (exactly the one-shot left padding) and passes the count on; a
transposed conv grows it. After the first call every later call has skip == 0. (Strided and
replicate-padded convs, Mimi's, assume skip == 0: nothing before them looks ahead.)

States start as the zeros the one-shot path pads with, so streaming equals one-shot exactly.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, TypeVar, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

S = TypeVar("S", bound="BatchedState")


def _map(obj: Any, fn) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(o, fn) for o in obj)
    if dataclasses.is_dataclass(obj):
        return type(obj)(**{f.name: _map(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)})
    return obj


def _zip(objs: Sequence[Any], fn) -> Any:
    first = objs[0]
    if isinstance(first, torch.Tensor):
        return fn(list(objs))
    if isinstance(first, (list, tuple)):
        return type(first)(_zip(parts, fn) for parts in zip(*objs, strict=True))
    if dataclasses.is_dataclass(first):
        return type(first)(**{f.name: _zip([getattr(o, f.name) for o in objs], fn)
                              for f in dataclasses.fields(first)})
    return first


class BatchedState:
    """Mixin for streaming-state dataclasses whose tensors (possibly nested in lists or other
    dataclasses) all carry the batch as their leading dim, so an engine can keep a pool of
    requests and batch any subset of them each step."""

    def select(self: S, rows: torch.Tensor | Sequence[int]) -> S:
        """The state of `rows` (in that order), as fresh tensors."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        return _map(self, lambda t: t.index_select(0, idx.to(t.device)))

    def assign(self, rows: torch.Tensor, src: S) -> None:
        """Write the rows of `src` (same structure, len(rows) rows) into rows `rows` of self, in place."""
        _zip([self, src], lambda ts: ts[0].index_copy_(0, rows.to(ts[0].device), ts[1]))

    @classmethod
    def concat(cls: type[S], states: Sequence[S]) -> S:
        """Stack the rows of several states (same module, same dtype) into one batch."""
        if not states:
            raise ValueError("concat needs at least one state")
        return _zip(states, lambda ts: torch.cat(ts, dim=0))


@runtime_checkable
class Streaming(Protocol):
    def init_state(self, batch: int, device: torch.device | str | None, dtype: torch.dtype) -> Any: ...

    def step(self, x: torch.Tensor, state: Any, skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def stream_init(modules: Sequence[nn.Module], batch: int, device, dtype: torch.dtype) -> list[Any]:
    """Per-module states of a sequential stack; None for stateless (pointwise) modules."""
    return [m.init_state(batch, device, dtype) if isinstance(m, Streaming) else None for m in modules]


def stream_step(modules: Sequence[nn.Module], states: Sequence[Any], x: torch.Tensor,
                skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a sequential stack incrementally (the streaming twin of `for m in modules: x = m(x)`)."""
    for m, s in zip(modules, states, strict=True):
        x, skip = (m(x), skip) if s is None else m.step(x, s, skip)
    return x, skip


class Residual(nn.Module):
    """x + block(x), `block` a sequence of streaming and pointwise modules (the codecs' residual units)."""

    def __init__(self, *modules: nn.Module):
        super().__init__()
        self.block = nn.Sequential(*modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)

    def init_state(self, batch: int, device, dtype: torch.dtype) -> list:
        return stream_init(self.block, batch, device, dtype)

    def step(self, x: torch.Tensor, state: list, skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, skip = stream_step(self.block, state, x, skip)
        return x + y, skip


def zero_prefix(x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """Zero the first skip[b] steps of row b. x: [B, C, L]; skip: [B]."""
    keep = torch.arange(x.shape[-1], device=x.device) >= skip.to(x.device)[:, None]  # [B, L]
    return torch.where(keep[:, None, :], x, x.new_zeros(()))


@dataclass
class ConvState(BatchedState):
    tail: torch.Tensor  # [B, C_in, k_eff - stride] last input steps (zeros before the stream starts)
    fresh: torch.Tensor | None = None  # [B] bool, "replicate" padding only: `tail` waits for the first input


class CausalConv1d(nn.Module):
    """Conv left-padded with k_eff - stride steps (k_eff = (k-1)*dilation + 1): n inputs (a multiple
    of the stride) give n / stride outputs, and output t reads inputs up to (t+1)*stride - 1.

    The padding is zeros, or ("replicate") copies of the stream's first input step.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1,
                 groups: int = 1, stride: int = 1, bias: bool = True, pad_mode: str = "constant"):
        super().__init__()
        if pad_mode not in ("constant", "replicate"):
            raise ValueError(f"causal conv padding must be 'constant' or 'replicate', got {pad_mode!r}")
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride=stride, dilation=dilation,
                              groups=groups, bias=bias)
        self.stride = stride
        self.context = (kernel_size - 1) * dilation + 1 - stride
        self.replicate = pad_mode == "replicate"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C_in, L] -> [B, C_out, L / stride]
        return self.conv(F.pad(x, (self.context, 0), mode="replicate" if self.replicate else "constant"))

    def init_state(self, batch: int, device, dtype: torch.dtype) -> ConvState:
        tail = torch.zeros(batch, self.conv.in_channels, self.context, device=device, dtype=dtype)
        fresh = torch.ones(batch, dtype=torch.bool, device=device) if self.replicate else None
        return ConvState(tail, fresh)

    def step(self, x: torch.Tensor, state: ConvState, skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = zero_prefix(x, skip)
        tail = state.tail
        if state.fresh is not None:  # NOTE: a fresh row's first step must not be a skipped one
            tail = torch.where(state.fresh[:, None, None], x[..., :1], tail)
            state.fresh = torch.zeros_like(state.fresh)
        full = torch.cat((tail, x), dim=-1)  # [B, C_in, ctx + n]
        state.tail = full[..., full.shape[-1] - self.context:].clone()
        return self.conv(full), skip


@dataclass
class TransConvState(BatchedState):
    prev: torch.Tensor  # [B, C_in, context] last input steps (zeros, or a placeholder with look-ahead, at the start)
    primed: torch.Tensor  # [B] bool: `prev` holds the stream's input (always, without look-ahead)


class CausalConvTranspose1d(nn.Module):
    """Transposed conv (kernel k = s or 2s, stride s) whose output block q (s samples) reads input
    steps q - context .. q + context' of the stream, context = (k - s) / s.

    `look_ahead=True` (Qwen3-Omni's Code2Wav): trimmed by k - s samples on BOTH sides, block q reads
    inputs q .. q + context, so L inputs give (L - context)·s samples: with k = 2s the last input
    step's block waits for the next step, and a one-shot call drops it for good.
    `look_ahead=False` (S2's codec, Mimi): trimmed on the right only, block q reads inputs
    q - context .. q (zeros before the stream), so L inputs give exactly L·s samples.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int,
                 groups: int = 1, bias: bool = True, look_ahead: bool = True):
        super().__init__()
        if kernel_size not in (stride, 2 * stride):
            raise ValueError(f"causal transposed conv needs kernel == stride or 2*stride, got {kernel_size}/{stride}")
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride, groups=groups,
                                       bias=bias)
        self.stride = stride
        self.trim = kernel_size - stride
        self.context = self.trim // stride
        self.look_ahead = look_ahead

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C_in, L] -> [B, C_out, (L - context)*s or L*s]
        y = self.conv(x)
        if not self.look_ahead:
            return y[..., : x.shape[-1] * self.stride]
        return y[..., self.trim: y.shape[-1] - self.trim]

    def init_state(self, batch: int, device, dtype: torch.dtype) -> TransConvState:
        prev = torch.zeros(batch, self.conv.in_channels, self.context, device=device, dtype=dtype)
        primed = torch.full((batch,), not self.look_ahead, dtype=torch.bool, device=device)
        return TransConvState(prev, primed)

    def step(self, x: torch.Tensor, state: TransConvState,
             skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """n new steps -> n*s samples; with look-ahead, a fresh row's first context*s of them are placeholders."""
        full = torch.cat((state.prev, x), dim=-1)  # [B, C_in, context + n]
        y = self.conv(full)[..., self.trim: self.trim + x.shape[-1] * self.stride]  # [B, C_out, n*s]
        missing = self.context * (~state.primed).long()  # [B]
        state.prev = full[..., full.shape[-1] - self.context:].clone()
        state.primed = torch.ones_like(state.primed)
        return y, (skip + missing) * self.stride


class ConvNeXtBlock(nn.Module):
    """x + gamma·pwconv2(gelu(pwconv1(LayerNorm(causal depthwise conv7(x))))): the codecs' ConvNeXt
    block (Code2Wav's upsampler, S2's codec), under their checkpoint names."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def _mix(self, y: torch.Tensor) -> torch.Tensor:  # [B, C, L] -> [B, C, L]
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y.transpose(1, 2)))))  # [B, L, C]
        return (self.gamma * y).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self._mix(self.dwconv(x))

    def init_state(self, batch: int, device, dtype: torch.dtype) -> ConvState:
        return self.dwconv.init_state(batch, device, dtype)

    def step(self, x: torch.Tensor, state: ConvState, skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, skip = self.dwconv.step(x, state, skip)
        return x + self._mix(y), skip
