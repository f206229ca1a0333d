"""A server process and everything it started (its Ray instance, tensor-parallel ranks), read with
psutil from outside: the sockets they listen on and the memory they hold."""
from __future__ import annotations

from dataclasses import dataclass

import psutil

LOOPBACK = ("127.0.0.1", "::1")


@dataclass(frozen=True)
class Listener:
    ip: str
    port: int
    pid: int
    process: str  # its command line

    def __str__(self) -> str:
        return f"{self.ip}:{self.port} pid {self.pid} {self.process[:100]}"


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def listeners(pid: int) -> list[Listener]:
    """Every TCP socket listening in `pid`'s tree, and every bound UDP socket."""
    out = []
    for p in tree(pid):
        try:
            name = " ".join(p.cmdline())
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN or (c.status == psutil.CONN_NONE and c.laddr):
                    out.append(Listener(c.laddr.ip, c.laddr.port, p.pid, name))
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return sorted(set(out), key=lambda x: (x.pid, x.port))


def rss(pid: int, children_only: bool = False) -> int:
    """Resident memory of `pid`'s tree (or of its descendants only), in bytes."""
    total = 0
    for p in tree(pid)[int(children_only):]:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return total
