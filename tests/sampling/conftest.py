"""A guard that fails on any host read of device data, and counts the aten ops of a call."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
SYNCING = {aten._local_scalar_dense, aten.item, aten.nonzero, aten.masked_select}
READERS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy")


class HostReadError(AssertionError):
    pass


def _refuse(name):
    def method(*args, **kwargs):
        raise HostReadError(f"Tensor.{name} reads the device")
    return method


class NoHostReads(TorchDispatchMode):
    """Inside: ops whose result needs device data on the host raise, and so do the Tensor methods
    that read it; every other aten op is recorded in `ops`."""

    def __init__(self):
        super().__init__()
        self.ops: list = []
        self._saved: dict = {}

    def __enter__(self):
        self._saved = {n: getattr(torch.Tensor, n) for n in READERS}
        for n in READERS:
            setattr(torch.Tensor, n, _refuse(n))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for n, m in self._saved.items():
                setattr(torch.Tensor, n, m)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in SYNCING:
            raise HostReadError(f"host read: {func}")
        if func.overloadpacket is aten.index and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
            raise HostReadError(f"bool-mask indexing: {func}")
        self.ops.append(func)
        return func(*args, **kwargs)


@pytest.fixture
def no_host_reads():
    return NoHostReads
