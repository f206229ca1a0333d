"""A fake device memory for the KV budget's tests (engine/memory.py's `DeviceMemory` seam)."""
from omnivox.engine.memory import DeviceMemory

GIB = 2**30


class Fake(DeviceMemory):
    """Devices of `total` bytes, this process holding `held[device]`; every measured step peaks at
    `peak` bytes; `cpu`: the CPU counts as measured (the profiling run on the tiny models)."""

    def __init__(self, total=80 * GIB, held=None, peak=0, cpu=False):
        self.total, self.held, self.peak_bytes, self.cpu = total, held or {}, peak, cpu
        self.measuring = None  # (device) while a step is measured

    def measures(self, device):
        return device.type == "cuda" or self.cpu

    def info(self, device):
        return self.total, int(self.held.get(str(device), 0))

    def begin(self, device):
        self.measuring = device

    def end(self, device):
        self.measuring = None
        return self.peak_bytes
