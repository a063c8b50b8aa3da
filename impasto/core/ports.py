"""A free TCP port on the loopback interface (rendezvous of tensor-parallel ranks, test and
benchmark servers). Free when asked: another process may take it before it is bound again."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
