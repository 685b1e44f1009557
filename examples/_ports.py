"""A free TCP port for a server a demo (or a test, or a fault-injection run) starts a moment later."""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]


#: Ports handed out by :func:`free_port` in this process (never handed out twice).
_HANDED_OUT: set[int] = set()


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server started later.

    Drawn at random from below the kernel's ephemeral range (``ip_local_port_range``), not with
    ``bind(0)``: a port from that range can become the local port of an outgoing connection before
    the server binds it (seen under a parallel test run: a Galera node that exited at start), and
    one from below it is taken only by another server. Never the same port twice in one process."""
    top = min(_ephemeral_start(), 32768)
    for _ in range(200):
        port = random.randrange(15000, top)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as sock:  # a crowded range: let the kernel choose
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
