"""A free TCP port for a torch.distributed rendezvous (MASTER_PORT) on this machine."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port on 127.0.0.1 that the OS just handed out (free now; another process could still take it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
