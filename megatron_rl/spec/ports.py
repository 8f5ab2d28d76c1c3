"""TCP ports for a torch.distributed rendezvous (MASTER_PORT): a free one on this machine, or a Slurm job's, which
every node computes alike."""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST_RENDEZVOUS_PORT = 20000


def free_port(*, floor: int | None = None) -> int:
    """A port on 127.0.0.1 that is free now, in [20000, the ephemeral floor): the OS never hands those to outgoing
    connections, so the hundreds that a running job's gloo opens cannot take it before the store listens (a local
    job got EADDRINUSE on a port the OS had just handed out while another job ran). Only a process binding that
    very port could; after 200 taken draws, the OS's pick."""
    floor = ephemeral_port_floor() if floor is None else floor
    span = floor - LOWEST_RENDEZVOUS_PORT if floor > LOWEST_RENDEZVOUS_PORT + 1000 else 10000
    draw = random.SystemRandom()
    for _ in range(200):
        port = LOWEST_RENDEZVOUS_PORT + draw.randrange(span)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ephemeral_port_floor(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port Linux hands out to outgoing connections (32768 by default)."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def rendezvous_port(job_id: int, restart: int = 0, *, floor: int | None = None) -> int:
    """A Slurm job's MASTER_PORT, the same on every node: in [20000, the ephemeral floor), since a port above it
    may be held by any outgoing connection when the store starts listening (gloo alone opens hundreds: a job got
    EADDRINUSE on submitit's pick in 20000-60000); a requeued run (``restart``) takes the next port."""
    floor = ephemeral_port_floor() if floor is None else floor
    span = floor - LOWEST_RENDEZVOUS_PORT if floor > LOWEST_RENDEZVOUS_PORT + 1000 else 10000
    return LOWEST_RENDEZVOUS_PORT + (job_id + restart) % span
