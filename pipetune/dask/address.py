"""Reaching a Dask scheduler that pipetune did not start: the address and its security.

A Dask scheduler runs whatever a client sends it, so a plain ``tcp://`` connection to
another host is an open door on the network between them. The rule:

- ``tcp://`` to a loopback address (127.0.0.0/8, ``::1``, ``localhost``) is fine;
- ``tls://`` anywhere, with the TLS files from pipetune's settings (below) or from
  Dask's own configuration (``distributed.comm.tls.*``);
- ``tcp://`` to any other host is refused unless explicitly allowed
  (``--allow-insecure-dask`` or ``PIPETUNE_DASK_ALLOW_INSECURE=1``), for a network the
  user trusts.

Settings (environment): ``PIPETUNE_DASK_ADDRESS`` (the default address),
``PIPETUNE_DASK_TLS_CA_FILE``, ``PIPETUNE_DASK_TLS_CERT``, ``PIPETUNE_DASK_TLS_KEY``
(the client's certificate and key, as ``distributed.security.Security`` takes them).

>>> check_scheduler_address("tcp://127.0.0.1:8786")
'tcp://127.0.0.1:8786'
>>> check_scheduler_address("tcp://10.0.0.5:8786")
Traceback (most recent call last):
...
pipetune.errors.SpecError: --dask-address: tcp://10.0.0.5:8786 is plain TCP to another host ...
"""

from __future__ import annotations

import ipaddress
import os
import re
from typing import Any

from pipetune.errors import SpecError

ADDRESS_ENV = "PIPETUNE_DASK_ADDRESS"
ALLOW_INSECURE_ENV = "PIPETUNE_DASK_ALLOW_INSECURE"
TLS_ENV = {
    "tls_ca_file": "PIPETUNE_DASK_TLS_CA_FILE",
    "tls_client_cert": "PIPETUNE_DASK_TLS_CERT",
    "tls_client_key": "PIPETUNE_DASK_TLS_KEY",
}

_ADDRESS = re.compile(r"^(tcp|tls|inproc|ucx)://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+)(:\d+)?$")


def default_address() -> str | None:
    """``$PIPETUNE_DASK_ADDRESS``, or ``None`` (the embedded cluster)."""
    return os.environ.get(ADDRESS_ENV, "").strip() or None


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _allowed_insecure(allow: bool | None) -> bool:
    if allow is not None:
        return allow
    return os.environ.get(ALLOW_INSECURE_ENV, "").strip().lower() in ("1", "true", "yes")


def check_scheduler_address(
    address: str, *, allow_insecure: bool | None = None, field: str = "--dask-address"
) -> str:
    """``address`` if pipetune may connect to it (the module's rule), else a
    :class:`SpecError` naming ``field`` and saying what would be accepted."""
    match = _ADDRESS.match(address)
    if not match:
        raise SpecError(field, f"must look like tcp://HOST:PORT or tls://HOST:PORT, "
                               f"got {address!r}")
    scheme, host = match.group(1), match.group(2)
    if scheme == "tcp" and not is_loopback(host) and not _allowed_insecure(allow_insecure):
        raise SpecError(
            field,
            f"{address} is plain TCP to another host: anyone on that network could run "
            "code on the cluster. Use tls:// with PIPETUNE_DASK_TLS_CA_FILE, "
            "PIPETUNE_DASK_TLS_CERT and PIPETUNE_DASK_TLS_KEY (or Dask's own TLS "
            "configuration), or, on a network you trust, allow it with "
            f"--allow-insecure-dask or {ALLOW_INSECURE_ENV}=1",
        )
    return address


def client_security() -> Any:
    """A ``distributed.security.Security`` from pipetune's TLS settings, or ``None``
    (Dask then reads its own configuration). A partial set is refused, naming what is
    missing."""
    given = {k: os.environ.get(env, "").strip() for k, env in TLS_ENV.items()}
    if not any(given.values()):
        return None
    missing = [TLS_ENV[k] for k, v in given.items() if not v]
    if missing:
        raise SpecError(missing[0], "is required when any of "
                                    f"{', '.join(TLS_ENV.values())} is set")
    for key, path in given.items():
        if not os.path.isfile(path):
            raise SpecError(TLS_ENV[key], f"no such file: {path}")
    from distributed.security import Security

    return Security(require_encryption=True, **given)


__all__ = [
    "ADDRESS_ENV",
    "ALLOW_INSECURE_ENV",
    "TLS_ENV",
    "check_scheduler_address",
    "client_security",
    "default_address",
    "is_loopback",
]
