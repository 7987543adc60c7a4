"""Where files that cross hosts live, named by URL: checkpoints and the best model.

Three kinds of location, chosen by the URL alone, so a worker needs nothing but the
reference it was handed:

- a local folder (the embedded default; fine while every worker shares the disk);
- any fsspec URL (``s3://bucket/x``, ``gs://...``, ``memory://`` in tests);
- MLflow's artifact proxy (``mlflow server --serve-artifacts``): ``mlflow-artifacts:``
  URIs, resolved once by the driver (:func:`resolve_location`) to the proxy's HTTP
  address ``http(s)://HOST/api/2.0/mlflow-artifacts/artifacts/<path>``. Workers then
  reach the tracking server over HTTP only; credentials come from MLflow's own
  environment (``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``, or
  ``MLFLOW_TRACKING_TOKEN``).

>>> storage_for("/tmp/x/epoch-001.pt").kind
'fsspec'
>>> storage_for("http://127.0.0.1:5000/api/2.0/mlflow-artifacts/artifacts/1/r/a.pt").kind
'mlflow-artifacts'
"""

from __future__ import annotations

import posixpath
from typing import Any
from urllib.parse import urlparse, urlunparse

from pipetune.errors import StorageError

#: The path under which MLflow's tracking server serves proxied artifacts.
PROXY_PATH = "/api/2.0/mlflow-artifacts/artifacts"


def resolve_location(location: str, tracking_uri: str | None = None) -> str:
    """``location`` as a URL every host can use: an ``mlflow-artifacts:`` URI becomes
    the proxy's HTTP address (its host from the URI, else from ``tracking_uri``, which
    must then be ``http(s)://``); anything else is returned as it is."""
    parsed = urlparse(location)
    if parsed.scheme != "mlflow-artifacts":
        return location
    if parsed.netloc:
        track = urlparse(tracking_uri or "")
        scheme = track.scheme if track.scheme in ("http", "https") else "http"
        base = (scheme, parsed.netloc, "")
    else:
        track = urlparse(tracking_uri or "")
        if track.scheme not in ("http", "https"):
            raise StorageError(
                f"{location}: an mlflow-artifacts: location needs an http(s) tracking "
                f"server (MLflow's artifact proxy), got tracking URI {tracking_uri!r}"
            )
        base = (track.scheme, track.netloc, track.path.rstrip("/"))
    path = posixpath.join(base[2] + PROXY_PATH, parsed.path.lstrip("/")).rstrip("/")
    return urlunparse((base[0], base[1], path, "", "", ""))


class Storage:
    """Whole-file operations on one kind of location (the interface both kinds share)."""

    kind = ""
    #: Whether a reader can see a file while it is being written (then a reader retries
    #: one that does not deserialise).
    partial_reads = False

    def read(self, url: str) -> bytes | None:
        """The file's bytes, or ``None`` when there is no such file."""
        raise NotImplementedError

    def write(self, url: str, data: bytes) -> None:
        """Write the whole file; a reader sees the old state or the new, never half."""
        raise NotImplementedError

    def exists(self, url: str) -> bool:
        raise NotImplementedError

    def remove(self, url: str) -> None:
        """Delete the file; one already gone is not an error."""
        raise NotImplementedError


class FsspecStorage(Storage):
    """A local folder or any fsspec URL."""

    kind = "fsspec"

    @staticmethod
    def _fs(url: str) -> tuple[Any, str]:
        import fsspec

        return fsspec.core.url_to_fs(url)

    def read(self, url: str) -> bytes | None:
        fs, path = self._fs(url)
        fs.invalidate_cache(path)
        try:
            with fs.open(path, "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None

    def write(self, url: str, data: bytes) -> None:
        fs, path = self._fs(url)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        tmp = f"{path}.tmp"
        try:
            with fs.open(tmp, "wb") as fh:
                fh.write(data)
        except BaseException:  # a full or refusing store: give back what the try took
            try:
                fs.rm(tmp)
            except OSError:
                pass
            raise
        fs.mv(tmp, path)  # readers never see a half-written file

    def exists(self, url: str) -> bool:
        fs, path = self._fs(url)
        fs.invalidate_cache(path)
        return fs.exists(path)

    def remove(self, url: str) -> None:
        fs, path = self._fs(url)
        try:
            fs.rm(path)
        except FileNotFoundError:
            pass


class MlflowArtifactStorage(Storage):
    """MLflow's artifact proxy over HTTP (PUT, GET, list, DELETE).

    An upload is one PUT; the server copies it into place, so a reader racing the copy
    can read a short file: :meth:`pipetune.checkpoints.CheckpointStore.load` retries a
    file that does not deserialise until its deadline.
    """

    kind = "mlflow-artifacts"
    partial_reads = True

    def _request(self, url: str, method: str, **kwargs: Any) -> Any:
        """``method`` on a proxy URL: MLflow's client with the server's credentials,
        on ``<api>/mlflow-artifacts/artifacts[/<path>]`` (no path: the listing)."""
        from mlflow.utils.credentials import get_default_host_creds
        from mlflow.utils.rest_utils import http_request

        api, _, rest = url.partition("/mlflow-artifacts/")
        try:
            return http_request(get_default_host_creds(api), f"/mlflow-artifacts/{rest}",
                                method, max_retries=3, **kwargs)
        except Exception as e:  # noqa: BLE001 - connection refused, DNS, TLS: say where
            raise StorageError(f"{method} {url}: {type(e).__name__}: {e}") from None

    def read(self, url: str) -> bytes | None:
        resp = self._request(url, "GET")
        if resp.status_code == 404:
            return None
        _raise_for(resp, "GET", url)
        return resp.content

    def write(self, url: str, data: bytes) -> None:
        resp = self._request(url, "PUT", data=data,
                             extra_headers={"Content-Type": "application/octet-stream"})
        _raise_for(resp, "PUT", url)

    def exists(self, url: str) -> bool:
        parent, name = url.rstrip("/").rsplit("/", 1)
        base, _, folder = parent.partition(PROXY_PATH)
        resp = self._request(base + PROXY_PATH, "GET", params={"path": folder.strip("/")})
        if resp.status_code == 404:
            return False
        _raise_for(resp, "GET", parent)
        files = resp.json().get("files", [])
        return any(posixpath.basename(f["path"]) == name and not f["is_dir"] for f in files)

    def remove(self, url: str) -> None:
        resp = self._request(url, "DELETE")
        if resp.status_code != 404:
            _raise_for(resp, "DELETE", url)


def _raise_for(resp: Any, method: str, url: str) -> None:
    if resp.status_code >= 400:
        raise StorageError(f"{method} {url}: HTTP {resp.status_code}: {resp.text[:200]}")


def is_local(url: str) -> bool:
    """Whether ``url`` is a path on this host's disk (a plain path or ``file://``)."""
    return urlparse(url).scheme in ("", "file")


_FSSPEC = FsspecStorage()
_MLFLOW = MlflowArtifactStorage()


def storage_for(url: str) -> Storage:
    """The storage a resolved URL lives on."""
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https") and PROXY_PATH in parsed.path:
        return _MLFLOW
    if parsed.scheme == "mlflow-artifacts":
        raise StorageError(f"{url}: resolve mlflow-artifacts: locations first "
                           "(pipetune.storage.resolve_location)")
    return _FSSPEC


__all__ = [
    "PROXY_PATH",
    "FsspecStorage",
    "MlflowArtifactStorage",
    "Storage",
    "StorageError",
    "is_local",
    "resolve_location",
    "storage_for",
]
