"""What this process and every process it started (its own Ray instance: GCS, raylet, agents,
workers) listen on, read from the kernel's socket tables (/proc; Linux only, elsewhere nothing
is found): `omnivox serve --replicas` prints it once it serves, so an operator sees what is open
where without asking Ray, which does not say."""
from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TABLES = (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6))
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


@dataclass(frozen=True)
class Listener:
    address: str
    port: int
    process: str  # "gcs_server", "raylet", "ray::ProxyActor", ...; "omnivox" for this process

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port} {self.process}"


def listening(pid: int | None = None) -> list[Listener]:
    """Every TCP socket listening in `pid`'s process tree (default: this process's)."""
    pid = pid or os.getpid()
    sockets = _listening_sockets()
    found = set()
    for p in _tree(pid):
        name = "omnivox" if p == pid else _name(p)
        for inode in _socket_inodes(p):
            if inode in sockets:
                found.add(Listener(*sockets[inode], name))
    return sorted(found, key=lambda x: (x.address, x.port))


def describe(found: list[Listener]) -> str:
    """One line: the listeners grouped by address (every interface, loopback, one address)."""
    groups: dict[str, list[str]] = {}
    for x in found:
        groups.setdefault(_scope(x.address), []).append(str(x))
    order = sorted(groups, key=lambda g: (g != "every interface", g != "loopback", g))
    return "; ".join(f"on {g}: " + ", ".join(groups[g]) for g in order) or "nothing found (not Linux?)"


def _scope(address: str) -> str:
    ip = ipaddress.ip_address(address)
    ip = getattr(ip, "ipv4_mapped", None) or ip  # ::ffff:127.0.0.1 is 127.0.0.1
    return "every interface" if ip.is_unspecified else "loopback" if ip.is_loopback else address


def _listening_sockets() -> dict[int, tuple[str, int]]:
    """socket inode -> (address, port) of every listening TCP socket on this machine."""
    out = {}
    for table, family in TABLES:
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == LISTEN:
                out[int(cols[9])] = _address(cols[1], family)
    return out


def _address(text: str, family: int) -> tuple[str, int]:
    """/proc/net/tcp's `HEXADDR:HEXPORT` (the address as 32-bit words in host order)."""
    hexaddr, hexport = text.split(":")
    raw = bytes.fromhex(hexaddr)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, raw), int(hexport, 16)


def _tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in PROC.glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    try:
        fds = list((PROC / str(pid) / "fd").iterdir())
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def _name(pid: int) -> str:
    """A Ray process's name: its worker title (`ray::ProxyActor`), else its program or script."""
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    if argv[0].startswith("ray::"):
        return argv[0].split()[0]
    script = next((a for a in argv[1:3] if a.endswith(".py")), None)
    return Path(script or argv[0]).name.removesuffix(".py") or "?"
