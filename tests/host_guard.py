"""The one guard of every "no host reads" test.

Inside `no_host_reads()` an op whose result needs device data on the host raises `HostRead`
(`item`, `nonzero`, `masked_select`, boolean-mask indexing, a copy of a device tensor to the CPU),
and so do the Tensor methods that read (`tolist`, `item`, `numpy`, `cpu`, truth value, `int`,
`float`, `__index__`); every aten op is counted in `ops`. `allow` says when a read is the
sanctioned one (the engine's `host.reading()`). Leaving it puts torch.Tensor back exactly as it
was: no method left behind in `torch.Tensor.__dict__`."""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READ_OPS = ("_local_scalar_dense", "item", "nonzero", "masked_select")
INDEXING = ("index", "index_put", "index_put_")
READ_METHODS = ("tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


class HostRead(AssertionError):
    pass


def _never() -> bool:
    return False


class Guard(TorchDispatchMode):
    def __init__(self, allow: Callable[[], bool] = _never):
        super().__init__()
        self.allow, self.ops = allow, Counter()

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[str(func)] += 1
        if not self.allow():
            name = func.overloadpacket.__name__
            if name in READ_OPS:
                raise HostRead(f"host read: {func}")
            if name in INDEXING and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                        for i in (args[1] or ())):
                raise HostRead(f"host read (boolean-mask indexing counts the mask): {func}")
            if name == "_to_copy" and kwargs.get("device") is not None \
                    and torch.device(kwargs["device"]).type == "cpu" and args[0].device.type != "cpu":
                raise HostRead("host read: a device tensor copied to the CPU")
        return func(*args, **kwargs)


def counting() -> Guard:
    """Counts the aten ops of a block (views included) and refuses nothing."""
    return Guard(allow=lambda: True)


@contextlib.contextmanager
def no_host_reads(allow: Callable[[], bool] = _never) -> Iterator[Guard]:
    own = {name: torch.Tensor.__dict__.get(name) for name in READ_METHODS}

    def refusing(name: str):
        original = getattr(torch.Tensor, name)

        def method(self, *a, **k):
            if not allow():
                raise HostRead(f"host read: Tensor.{name}")
            return original(self, *a, **k)
        return method

    for name in READ_METHODS:
        setattr(torch.Tensor, name, refusing(name))
    try:
        with Guard(allow) as guard:
            yield guard
    finally:
        for name, method in own.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)
