"""A port for a test's server or rendezvous that the test passes on by number."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port of 127.0.0.1 free now (released before it is used: only for a process that
    must be told its port, such as a server's ``--port`` or torchrun's ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
