"""Network helpers shared by the servers pipetune starts (Prefect, the team stack) and
the clients that talk to them."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` right now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def api_unreachable(error: BaseException | None) -> bool:
    """Whether ``error`` (or what caused it) says an HTTP API did not answer: refused,
    reset, timed out, or a 502/503/504 from a proxy in front of it."""
    seen = 0
    while error is not None and seen < 10:
        names = {f"{c.__module__}.{c.__name__}" for c in type(error).__mro__}
        if {"httpx.TransportError", "httpcore.NetworkError", "httpcore.TimeoutException"} \
                & names:
            return True
        status = getattr(getattr(error, "response", None), "status_code", 0)
        if status in (502, 503, 504):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now (connections of a server
    stopped a moment ago, in TIME_WAIT, do not count: servers bind with SO_REUSEADDR)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
