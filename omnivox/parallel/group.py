"""A tensor-parallel group: this process's rank among `size`, and the collectives the sharded layers
(a sum for row-parallel outputs, a gather for vocab-parallel logits) and the step broadcast call.

The group is a process group of its own (`ProcessGroupGloo` / `ProcessGroupNCCL` over a TCP store
that rank 0 hosts), not torch.distributed's process-global default group: one process may hold
several (a test, a server restarting its engine), and nothing global is left behind.

Where it listens: the store on `host` only (127.0.0.1 when every rank is local; the node's IP
under Ray, where ranks may be on other nodes), and each gloo rank's pair sockets on its own
address (`bind`: 127.0.0.1 for local ranks, its node's IP under Ray), never on every interface.
Neither carries authentication: under Ray keep the nodes' network closed to others (README).

NOTE: every rank must issue the same collectives in the same order; a rank that stops issuing them
blocks the others until `timeout_s` (then the collective raises on the waiting ranks), while a rank
that exits makes them raise at once (its sockets close). Either way a collective raises
`WorkerFailure` (503 `engine_failed`), wherever it runs: the step's broadcast or a sharded layer.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from omnivox.errors import EngineFailed


class WorkerFailure(EngineFailed):
    """A tensor-parallel rank died or raised: the engine cannot compute the Thinker any more."""


@dataclass
class TPGroup:
    rank: int
    size: int
    group: object  # this group's ProcessGroup (gloo or NCCL)
    device: torch.device = torch.device("cpu")  # where NCCL's buffers live (gloo: the host)
    backend: str = "gloo"  # gloo copies device tensors through host memory

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks (x's shape, dtype and device). x itself may be overwritten: the
        callers pass a fresh partial product."""
        y = self._staged(x)
        _collective(lambda: self.group.allreduce([y]))
        return y.to(x.device)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated in rank order along `dim`: [..., n, ...] -> [..., size * n, ...]."""
        y = self._staged(x)
        parts = [torch.empty_like(y) for _ in range(self.size)]
        _collective(lambda: self.group.allgather([parts], [y]))
        return torch.cat(parts, dim=dim).to(x.device)

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0 sends `data`; every other rank passes None and gets it."""
        where = self.device if self.backend == "nccl" else torch.device("cpu")
        size = torch.tensor([len(data) if self.rank == 0 else 0], dtype=torch.int64, device=where)
        _collective(lambda: self.group.broadcast(size, 0))
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(where)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8, device=where)
        _collective(lambda: self.group.broadcast(buf, 0))
        return data if self.rank == 0 else buf.cpu().numpy().tobytes()

    def _staged(self, x: torch.Tensor) -> torch.Tensor:
        """x as the backend takes it: contiguous, and on the host for gloo (a device tensor is copied)."""
        x = x.contiguous()
        return x.cpu() if self.backend == "gloo" and x.device.type != "cpu" else x

    def close(self) -> None:
        """Drop the process group (its sockets close when it is freed)."""
        self.group = None


def _collective(issue) -> None:
    """Issue one collective and wait for it; a peer that died (its socket closed) or timed out is a
    WorkerFailure."""
    try:
        issue().wait()
    except RuntimeError as e:
        raise WorkerFailure(f"a tensor-parallel collective failed ({str(e).strip().splitlines()[0][:200]})") from None


def host_store(size: int, port: int = 0, timeout_s: float = 60, host: str = "127.0.0.1") -> dist.TCPStore:
    """Rank 0's rendezvous, listening on `host` only (`port` 0: a free one, read back from `.port`).
    NOTE: a TCPStore that opens its own socket listens on every interface (IPv4 and IPv6) whatever
    `host` says; one given a listening socket (`master_listen_fd`) listens there only, and owns it
    (it closes the socket when it is freed)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(max(size, 16))
        port, fd = sock.getsockname()[1], sock.detach()  # the store's from here on
    try:
        return dist.TCPStore(host, port, size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                             master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def init_group(rank: int, size: int, port: int, device: torch.device | str = "cpu", store: dist.TCPStore | None = None,
               timeout_s: float = 60, backend: str | None = None, host: str = "127.0.0.1",
               bind: str | None = None) -> TPGroup:
    """Join the group of `size` whose rendezvous is `host`:`port` (rank 0 hosts it: `store` from
    `host_store`, or one opened here on `port`). NCCL for a CUDA device (the caller selects it
    first), gloo otherwise (or `backend="gloo"`: two ranks on one GPU, staged through the host),
    its sockets on `bind` (this rank's own address; default `host`); `timeout_s` bounds the
    rendezvous and every collective."""
    device = torch.device(device)
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = host_store(size, port, timeout_s, host) if rank == 0 else \
            dist.TCPStore(host, port, size, False, timeout=timeout)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind or host)]  # not the hostname's address
        pg = dist.ProcessGroupGloo(store, rank, size, opts)
    return TPGroup(rank, size, pg, device, backend)
