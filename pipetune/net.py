"""Network helpers shared by the servers pipetune starts (Prefect, the team stack) and
the clients that talk to them."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

#: The longest path an ``AF_UNIX`` socket address holds (``sun_path``, 108 bytes with
#: its final NUL on Linux).
UNIX_PATH_MAX = 107


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


@contextlib.contextmanager
def unix_address(path: str | os.PathLike) -> Iterator[str]:
    """An address for ``bind``/``connect`` that names the socket file ``path``, however
    deep it is: ``path`` itself when it fits a socket address, else the same file
    reached through an open handle on its folder (``/proc/self/fd/N/name``). The handle
    is closed on leaving; a bound or connected socket does not need it any more."""
    path = os.fspath(path)
    if len(os.fsencode(path)) <= UNIX_PATH_MAX:
        yield path
        return
    folder, name = os.path.split(path)
    fd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)
