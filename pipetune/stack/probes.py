"""Asking the stack's servers whether they are up, and the few calls made to the Prefect
API while starting it: plain HTTP and TCP, no Prefect import; ``distributed.Client``
only to count the Dask workers.
"""

from __future__ import annotations

import contextlib
import json
import socket
import urllib.error
import urllib.request
from typing import Any

from pipetune.errors import PipetuneError

_NET_ERRORS = (urllib.error.URLError, OSError, TimeoutError, ValueError)


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except _NET_ERRORS:
        return False


def tcp_ok(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _call(url: str, method: str = "GET", body: Any = None, timeout: float = 5.0,
          headers: dict[str, str] | None = None) -> Any:
    """A JSON request; its decoded answer (None when empty). HTTP errors propagate."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw.strip() else None


def ensure_work_pool(api: str, pool: str, kind: str, concurrency_limit: int | None,
                     headers: dict[str, str] | None = None) -> None:
    """Create work pool ``pool`` of type ``kind`` with ``concurrency_limit``, or set that
    limit on the existing pool. Its base job template is left empty: the first worker
    of that type fills in its default (as ``prefect work-pool create`` would)."""
    try:
        _call(f"{api}/work_pools/", "POST",
              {"name": pool, "type": kind, "concurrency_limit": concurrency_limit},
              headers=headers)
        return
    except urllib.error.HTTPError as e:
        if e.code != 409:  # 409: it exists already
            raise PipetuneError(f"creating work pool {pool!r} at {api} failed: HTTP {e.code} "
                                f"{e.read()[:2000].decode(errors='replace')}") from None
    except _NET_ERRORS as e:
        raise PipetuneError(f"creating work pool {pool!r} at {api} failed: {e}") from None
    try:
        _call(f"{api}/work_pools/{pool}", "PATCH", {"concurrency_limit": concurrency_limit},
              headers=headers)
    except _NET_ERRORS as e:
        raise PipetuneError(f"setting the concurrency limit of work pool {pool!r} at {api} "
                            f"failed: {e}") from None


def pool_has_worker(api: str, pool: str, worker: str,
                    headers: dict[str, str] | None = None) -> bool:
    """Whether ``worker`` polls ``pool`` and the pool has its base job template (the
    worker's sync is done)."""
    try:
        workers = _call(f"{api}/work_pools/{pool}/workers/filter", "POST", {}, timeout=3.0,
                        headers=headers)
        if not any(w.get("name") == worker for w in workers):
            return False
        pool_info = _call(f"{api}/work_pools/{pool}", timeout=3.0, headers=headers)
        return bool(pool_info.get("base_job_template"))
    except _NET_ERRORS:
        return False


class DaskCount:
    """The names of the workers a Dask scheduler knows, through one client."""

    def __init__(self, address: str, security: Any = None):
        self.address = address
        self.security = security
        self.client: Any = None

    def has(self, name: str) -> bool:
        try:
            if self.client is None:
                from distributed import Client

                self.client = Client(self.address, timeout=10, set_as_default=False,
                                     security=self.security)
            info = self.client.scheduler_info(n_workers=-1)
        except OSError:
            return False
        return any(w.get("name") == name for w in info.get("workers", {}).values())

    def close(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
            self.client = None
