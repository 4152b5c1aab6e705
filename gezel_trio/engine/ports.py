"""Picking a TCP port for a process the host (or a benchmark, or a test) starts."""

from __future__ import annotations

import socket

__all__ = ["free_port", "port_in_use"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (another process may take it before it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a process listens on ``port`` now (a port left in TIME_WAIT is not in use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False
