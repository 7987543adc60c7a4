"""The stack's locks: TLS on Dask, basic auth on MLflow, an auth string on Prefect.

``pipetune stack up`` reads them from the same environment variables a client of the
stack sets, so one shell both starts a locked stack and uses it:

- ``PIPETUNE_DASK_TLS_CA_FILE``, ``PIPETUNE_DASK_TLS_CERT``, ``PIPETUNE_DASK_TLS_KEY``:
  the scheduler and the workers listen on ``tls://`` with this certificate and key, and
  accept only peers whose certificate that CA signed (mutual TLS, encryption required);
- ``MLFLOW_TRACKING_USERNAME`` and ``MLFLOW_TRACKING_PASSWORD``: MLflow runs its
  ``basic-auth`` app with that user as its admin (created on the first start; its users
  live in ``DIR/mlflow/basic_auth.db``; a later start keeps the stored password);
- ``PREFECT_API_AUTH_STRING`` (or ``PREFECT_SERVER_API_AUTH_STRING``): the Prefect
  server answers only requests carrying it (``/api/health`` excepted).

Each lock is independent; none set means the stack of before. The secrets travel to the
components in their environment, never on a command line, and are written to no file of
the stack (``stack.json`` records which locks are on and the TLS files' paths only).
"""

from __future__ import annotations

import base64
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipetune.dask.address import TLS_ENV
from pipetune.errors import PipetuneError

#: What a client of a locked stack sets; none of it reaches a component unless needed.
SECRET_ENV = ("PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING",
              "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
              "MLFLOW_TRACKING_TOKEN", "MLFLOW_AUTH_ADMIN_USERNAME",
              "MLFLOW_AUTH_ADMIN_PASSWORD", *TLS_ENV.values())


@dataclass(frozen=True)
class Doors:
    """Which locks the stack has, and their keys (never in ``repr``)."""

    prefect_auth: str | None = field(default=None, repr=False)
    mlflow_user: str | None = None
    mlflow_password: str | None = field(default=None, repr=False)
    #: ``tls_ca_file``, ``tls_client_cert``, ``tls_client_key`` (paths), or None.
    dask_tls: dict[str, str] | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Doors:
        env = os.environ if environ is None else environ
        prefect = (env.get("PREFECT_API_AUTH_STRING", "").strip()
                   or env.get("PREFECT_SERVER_API_AUTH_STRING", "").strip() or None)
        user = env.get("MLFLOW_TRACKING_USERNAME", "").strip() or None
        password = env.get("MLFLOW_TRACKING_PASSWORD", "") or None
        if bool(user) != bool(password):
            raise PipetuneError("MLflow's basic auth needs both MLFLOW_TRACKING_USERNAME and "
                                "MLFLOW_TRACKING_PASSWORD (or neither)")
        if password is not None and len(password) < 12:
            raise PipetuneError("MLFLOW_TRACKING_PASSWORD: MLflow's basic auth wants at least "
                                "12 characters")
        tls = None
        given = {k: env.get(n, "").strip() for k, n in TLS_ENV.items()}
        if any(given.values()):
            for key, path in given.items():
                if not path or not os.path.isfile(os.path.expanduser(path)):
                    raise PipetuneError(
                        f"{TLS_ENV[key]}: " + ("no such file: " + path if path else
                                               "required when any of "
                                               f"{', '.join(TLS_ENV.values())} is set"))
            tls = {k: str(Path(v).expanduser().absolute()) for k, v in given.items()}
        return cls(prefect, user, password, tls)

    @property
    def scheme(self) -> str:
        return "tls" if self.dask_tls else "tcp"

    def dask_args(self) -> list[str]:
        """``dask scheduler`` / ``dask worker`` options: file paths, no secret."""
        if not self.dask_tls:
            return []
        t = self.dask_tls
        return ["--tls-ca-file", t["tls_ca_file"], "--tls-cert", t["tls_client_cert"],
                "--tls-key", t["tls_client_key"]]

    def dask_security(self) -> Any:
        if not self.dask_tls:
            return None
        from distributed.security import Security

        return Security(require_encryption=True, **self.dask_tls)

    def prefect_headers(self) -> dict[str, str]:
        if not self.prefect_auth:
            return {}
        token = base64.b64encode(self.prefect_auth.encode()).decode()
        return {"Authorization": f"Basic {token}"}

    def client_env(self) -> dict[str, str]:
        """What a process that uses the stack needs (the Prefect worker, Dask workers)."""
        env: dict[str, str] = {}
        if self.prefect_auth:
            env["PREFECT_API_AUTH_STRING"] = self.prefect_auth
        if self.mlflow_user and self.mlflow_password:
            env["MLFLOW_TRACKING_USERNAME"] = self.mlflow_user
            env["MLFLOW_TRACKING_PASSWORD"] = self.mlflow_password
        if self.dask_tls:
            env.update({TLS_ENV[k]: v for k, v in self.dask_tls.items()})
        return env

    def mlflow_server_env(self, folder: Path) -> dict[str, str]:
        """The basic-auth app's settings: its configuration file (no password in it),
        the admin in the environment, a Flask secret key kept in ``folder`` (0600)."""
        if not (self.mlflow_user and self.mlflow_password):
            return {}
        db = folder / "basic_auth.db"
        ini = folder / "basic_auth.ini"
        ini.write_text("[mlflow]\ndefault_permission = READ\n"
                       f"database_uri = sqlite:///{db}\n"
                       "authorization_function = "
                       "mlflow.server.auth:authenticate_request_basic_auth\n")
        return {"MLFLOW_AUTH_CONFIG_PATH": str(ini),
                "MLFLOW_AUTH_ADMIN_USERNAME": self.mlflow_user,
                "MLFLOW_AUTH_ADMIN_PASSWORD": self.mlflow_password,
                "MLFLOW_FLASK_SERVER_SECRET_KEY": _secret_file(folder / "flask-secret-key")}

    def summary(self) -> dict[str, Any]:
        """For ``stack.json``: which locks are on; no secret."""
        return {"dask_tls": dict(self.dask_tls) if self.dask_tls else None,
                "mlflow_basic_auth": self.mlflow_user,
                "prefect_auth_string": bool(self.prefect_auth)}


def _secret_file(path: Path) -> str:
    """The secret in ``path``, created (mode 0600) on first use."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    value = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value
