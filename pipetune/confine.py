"""What a run sent through a deployment may touch: folders, URLs and workload modules.

Whoever can create a flow run of a deployment chooses its parameters, but the run
executes on the worker, as the worker's user. So a deployment run may only name paths
(``job`` files, ``checkpoint_root``, ``groundtruth_path``, a file-backed
``tracking_uri``) under the roots the worker allows, and import-path workloads
(``package.module:Class``) only from modules it allows. The worker's environment
sets both; the local ``pipetune tune`` is the user's own machine and is not confined.

- ``PIPETUNE_ALLOWED_ROOTS``: folders and URL prefixes, separated by ``os.pathsep``
  (``/data/jobs:/scratch:s3://team-bucket/pipetune``). Unset or blank: the pipetune
  home (``$PIPETUNE_HOME``, ``~/.pipetune``) and the working folder. A local path is
  checked after ``~``, ``..`` and symlinks are resolved; a URL (``s3://...``,
  ``https://...``) only by prefix, on ``/`` boundaries, and never with a ``..``.
- ``PIPETUNE_ALLOWED_MODULES``: comma-separated module prefixes (``mylab,team.models``
  allows ``mylab.x:Net`` and ``team.models.cnn:CNN``, not ``mylabs:Net``); ``*``
  allows every module. Built-in workloads (``lenet5``, ...) and
  ``pipetune.workloads.*`` are always allowed; by default nothing else is.

>>> policy = Confinement(roots=("/srv/jobs",), modules=("mylab",))
>>> policy.check_path("job", "/srv/jobs/a/../b.yaml")
'/srv/jobs/b.yaml'
>>> policy.check_workload("mylab.nets:Net")
>>> policy.check_workload("os:system")
Traceback (most recent call last):
...
pipetune.errors.ConfinementError: workload.name: workload 'os:system' imports module 'os', \
which this worker does not allow (allowed: built-ins, pipetune.workloads, mylab); \
set PIPETUNE_ALLOWED_MODULES on the worker to allow it

Refusals are :class:`~pipetune.errors.ConfinementError` (a ``SpecError``) naming the
field. :func:`enforced` makes :func:`pipetune.workloads.resolve_workload` check the
active policy before it imports anything, so a job file's workload is refused before
its module runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from pipetune.errors import ConfinementError

ROOTS_ENV = "PIPETUNE_ALLOWED_ROOTS"
MODULES_ENV = "PIPETUNE_ALLOWED_MODULES"

#: Import-path workloads under these modules are pipetune's own: always allowed.
BUILTIN_MODULES: tuple[str, ...] = ("pipetune.workloads",)

#: Environment a run must not set for itself through job variables: the policy and
#: the worker's own defaults (which are not checked) are the worker's to set.
WORKER_ENV: tuple[str, ...] = (
    ROOTS_ENV, MODULES_ENV, "PIPETUNE_HOME", "MLFLOW_TRACKING_URI", "PIPETUNE_GROUNDTRUTH",
    "PIPETUNE_CHECKPOINTS",
)

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*$")
_active: contextvars.ContextVar[Confinement | None] = contextvars.ContextVar(
    "pipetune_confinement", default=None
)


def _is_url(value: str) -> bool:
    """``scheme://...`` or an fsspec chain (``simplecache::s3://...``); not ``C:\\x``."""
    if "::" in value:
        return True
    scheme, sep, _ = value.partition("://")
    return bool(sep) and len(scheme) > 1 and bool(_SCHEME.match(scheme))


def _normal_url(value: str) -> str:
    scheme, _, rest = value.partition("://")
    return f"{scheme.lower()}://{rest}".rstrip("/")


def _local(value: str, cwd: Path, expanduser: bool = True) -> Path:
    """Where a local path lands: ``~`` expanded (fsspec and the ground truth do),
    relative to ``cwd``, ``..`` and symlinks resolved."""
    path = Path(value).expanduser() if expanduser else Path(value)
    if not path.is_absolute():
        path = cwd / path
    return Path(os.path.realpath(path))


def split_roots(raw: str, sep: str = os.pathsep) -> list[str]:
    """The entries of a ``PIPETUNE_ALLOWED_ROOTS`` value.

    With ``:`` as the separator a URL's own colons (``s3://b``, ``https://h:5000/x``)
    are kept in its entry.

    >>> split_roots("/data:s3://bucket/p:https://mlflow:5000/x:/home/me", sep=":")
    ['/data', 's3://bucket/p', 'https://mlflow:5000/x', '/home/me']
    """
    pieces = [p.strip() for p in raw.split(sep)]
    if sep != ":":
        return [p for p in pieces if p]
    out: list[str] = []
    for piece in pieces:
        if out and piece.startswith("//") and _SCHEME.match(out[-1]) and len(out[-1]) > 1:
            out[-1] = f"{out[-1]}:{piece}"  # scheme : //rest
        elif (out and "://" in out[-1] and "/" not in out[-1].partition("://")[2]
              and re.match(r"^\d+(/|$)", piece)):
            out[-1] = f"{out[-1]}:{piece}"  # scheme://host : port/rest
        else:
            out.append(piece)
    return [p for p in out if p]


def split_modules(raw: str) -> list[str]:
    """The entries of a ``PIPETUNE_ALLOWED_MODULES`` value, checked.

    >>> split_modules(" mylab, team.models. ,")
    ['mylab', 'team.models']
    """
    out: list[str] = []
    for entry in (e.strip().rstrip(".") for e in raw.split(",")):
        if not entry:
            continue
        if entry != "*" and not _MODULE.match(entry):
            raise ConfinementError(
                MODULES_ENV, f"{entry!r} is not a module name (like mylab or team.models) or *"
            )
        out.append(entry)
    return out


@dataclass(frozen=True)
class Confinement:
    """The roots and modules a deployment run may use (see the module docstring).

    ``roots``: local folders (absolute, resolved) and URL prefixes. ``modules``:
    module prefixes allowed for import-path workloads, beyond the built-ins; ``"*"``
    allows all. ``cwd``: what relative paths are relative to (the run's working
    folder; ``None``: the process's at check time).
    """

    roots: tuple[str, ...]
    modules: tuple[str, ...] = ()
    cwd: str | None = None

    def __post_init__(self) -> None:
        base = Path(self.cwd or os.getcwd())
        roots = tuple(_normal_url(r) if _is_url(r) else str(_local(r, base)) for r in self.roots)
        object.__setattr__(self, "roots", roots)
        object.__setattr__(self, "modules", tuple(m.rstrip(".") for m in self.modules))

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, cwd: str | Path | None = None
    ) -> Confinement:
        """The policy ``environ`` (default ``os.environ``) sets, with its defaults."""
        from pipetune.home import HOME_ENV

        env = os.environ if environ is None else environ
        cwd = str(cwd or os.getcwd())
        roots = split_roots(env.get(ROOTS_ENV, ""))
        if not roots:  # the pipetune home, read as pipetune_home() reads it, and cwd
            raw_home = env.get(HOME_ENV, "").strip()
            home = Path(raw_home).expanduser() if raw_home else Path.home() / ".pipetune"
            roots = [str(home), cwd]
        return cls(roots=tuple(roots), modules=tuple(split_modules(env.get(MODULES_ENV, ""))),
                   cwd=cwd)

    # -- paths ---------------------------------------------------------------------
    def _refuse_path(self, field: str, value: str) -> ConfinementError:
        return ConfinementError(
            field,
            f"{value} is outside the allowed roots ({os.pathsep.join(self.roots)}); "
            f"set {ROOTS_ENV} on the worker to allow it",
        )

    def check_path(
        self, field: str, value: str | os.PathLike[str], *, expanduser: bool = True
    ) -> str:
        """``value`` (a local path or a URL) if it lies under an allowed root: a local
        path absolute and resolved (use that, so what was checked is what is opened), a
        URL as given; else :class:`ConfinementError` naming ``field``. ``expanduser``:
        whether whoever opens it expands ``~`` (fsspec and the ground truth do)."""
        if not isinstance(value, str | os.PathLike) or not str(value).strip():
            raise ConfinementError(field, f"must be a path, got {value!r}")
        text = str(value).strip()
        if "\x00" in text:
            raise ConfinementError(field, "a path cannot hold a NUL character")
        if text.startswith("file://"):
            parts = urlsplit(text)
            if parts.netloc not in ("", "localhost"):
                raise self._refuse_path(field, text)
            text = unquote(parts.path)
        if _is_url(text):
            url = _normal_url(text)
            if ".." in url.replace("::", "/").split("/"):
                raise ConfinementError(field, f"{text}: a URL with '..' is not allowed")
            for root in (r for r in self.roots if _is_url(r)):
                if url == root or url.startswith(f"{root}/"):
                    return text
            raise self._refuse_path(field, text)
        path = _local(text, Path(self.cwd or os.getcwd()), expanduser)
        for root in (r for r in self.roots if not _is_url(r)):
            if path.is_relative_to(root):
                return str(path)
        raise self._refuse_path(field, text if text == str(path) else f"{text} ({path})")

    def check_tracking_uri(self, field: str, value: str) -> None:
        """An MLflow tracking URI: a file-backed store (``sqlite:///...``, ``file:``, a
        bare path) is checked as a path; a server (``http://``, ``postgresql://``) must
        be listed as a root prefix. ``sqlite://`` (in memory) writes no file."""
        text = str(value).strip()
        if text == "sqlite://" or text.startswith("sqlite://?"):
            return
        if text.startswith("sqlite:///"):
            text = unquote(text[len("sqlite:///"):].partition("?")[0])
        elif text.startswith("file:") and not text.startswith("file://"):
            text = unquote(text[len("file:"):])
        self.check_path(field, text, expanduser=False)

    # -- workloads -----------------------------------------------------------------
    def allows_module(self, module: str) -> bool:
        return any(
            entry == "*" or module == entry or module.startswith(f"{entry}.")
            for entry in (*BUILTIN_MODULES, *self.modules)
        )

    def check_workload(self, name: str, field: str = "workload.name") -> None:
        """Refuse an import-path workload whose module is not allowed. Built-in names
        (``lenet5``: no ``module:``) pass; a malformed name is left for
        :func:`~pipetune.workloads.resolve_workload` to report."""
        name = str(name).strip()
        if ":" not in name:
            return
        module = name.partition(":")[0].strip()
        if self.allows_module(module):
            return
        allowed = ", ".join(("built-ins", *BUILTIN_MODULES, *self.modules))
        raise ConfinementError(
            field,
            f"workload {name!r} imports module {module!r}, which this worker does not "
            f"allow (allowed: {allowed}); set {MODULES_ENV} on the worker to allow it",
        )

    # -- the run's own infrastructure overrides --------------------------------------
    def check_job_variables(self, job_variables: Mapping[str, object] | None) -> None:
        """Refuse a run that sets the policy's inputs for itself: its job variables'
        ``env`` naming one of :data:`WORKER_ENV`, or a ``working_dir`` (where relative
        paths resolve, a default root)."""
        if not job_variables:
            return
        env = job_variables.get("env")
        for key in WORKER_ENV:
            if isinstance(env, Mapping) and key in env:
                raise ConfinementError(
                    f"job_variables.env.{key}",
                    "is the worker's to set, not a run's: set it on the worker",
                )
        if job_variables.get("working_dir") is not None:
            raise ConfinementError(
                "job_variables.working_dir",
                "is the deployment's to set, not a run's: relative paths resolve there",
            )


# -- the active policy (what resolve_workload checks) -----------------------------------
def active() -> Confinement | None:
    """The policy :func:`enforced` set in this context, if any."""
    return _active.get()


@contextlib.contextmanager
def enforced(policy: Confinement | None) -> Iterator[Confinement | None]:
    """Within the block, :func:`~pipetune.workloads.resolve_workload` refuses a module
    ``policy`` does not allow before importing it. ``None``: nothing is enforced."""
    token = _active.set(policy)
    try:
        yield policy
    finally:
        _active.reset(token)


def check_path(field: str, value: str | os.PathLike[str]) -> str:
    """:meth:`Confinement.check_path` under the policy of this process's environment."""
    return Confinement.from_env().check_path(field, value)


def check_workload(name: str, field: str = "workload.name") -> None:
    """:meth:`Confinement.check_workload` under this process's environment."""
    Confinement.from_env().check_workload(name, field)


__all__ = [
    "BUILTIN_MODULES",
    "MODULES_ENV",
    "WORKER_ENV",
    "ROOTS_ENV",
    "Confinement",
    "active",
    "check_path",
    "check_workload",
    "enforced",
    "split_modules",
    "split_roots",
]


#: Flow parameters naming files a run writes (checked with ``~`` expanded, as their
#: stores read them); ``job`` (a job file) and ``tracking_uri`` are checked apart.
STORE_PARAMETERS = ("checkpoint_root", "groundtruth_path")


def confine_parameters(
    params: Mapping[str, Any],
    *,
    from_deployment: bool,
    job_variables: Mapping[str, Any] | None = None,
    policy: Confinement | None = None,
) -> tuple[dict[str, Any], Confinement | None]:
    """``params`` with the paths a deployment run names checked against the worker's
    :class:`~pipetune.confine.Confinement` (``policy``, default: from this process's
    environment), and that policy; untouched, and ``None``, for a run not from a
    deployment (``pipetune tune`` on the user's own machine).

    Checked: a job file path, ``checkpoint_root``, ``groundtruth_path``, a
    ``tracking_uri`` other than the worker's own default, an inline job's import-path
    workload, and the run's own ``job_variables`` (it may not set the policy). Checked
    local paths come back absolute and resolved, so what was checked is what is opened.
    Raises :class:`~pipetune.errors.ConfinementError` naming the parameter, before
    anything is recorded.
    """
    checked = dict(params)
    if not from_deployment:
        return checked, None
    policy = policy or Confinement.from_env()
    policy.check_job_variables(job_variables)
    job = params.get("job")
    if isinstance(job, str):  # load_spec opens it as given: no ~ expansion
        checked["job"] = policy.check_path("job", job, expanduser=False)
    elif isinstance(job, Mapping) and isinstance(job.get("workload"), Mapping):
        name = job["workload"].get("name")
        if isinstance(name, str):
            policy.check_workload(name, field="job.workload.name")
    _check_stores(policy, checked)
    return checked, policy


def confine_resumed(header: dict[str, Any], policy: Confinement | None) -> dict[str, Any]:
    """A resumed study's journal header, its stores checked as a new run's would be
    (it may have started outside a deployment) but kept as recorded (its checkpoint
    references start with them); the job's workload is checked when it is resolved,
    under :func:`~pipetune.confine.enforced`."""
    if policy is not None:
        _check_stores(policy, dict(header), where="resume: the study's ")
    return header


#: Store values that name no path: ``checkpoint_root: mlflow`` writes into the study's
#: own MLflow run (its tracking URI is checked on its own).
_WORKER_OWN: dict[str, tuple[str, ...]] = {"checkpoint_root": ("mlflow",)}
#: The environment variable holding the worker's own default for a store parameter.
_STORE_ENV = {"groundtruth_path": "PIPETUNE_GROUNDTRUTH",
              "checkpoint_root": "PIPETUNE_CHECKPOINTS"}


def _env_default(name: str) -> str | None:
    return os.environ.get(_STORE_ENV[name]) or None


def _check_stores(policy: Confinement, values: dict[str, Any], where: str = "") -> None:
    """Check the stores in ``values``, putting the resolved local paths back."""
    for name in STORE_PARAMETERS:
        own = (*_WORKER_OWN.get(name, ()), _env_default(name))
        if values.get(name) in own:
            continue  # the worker's own store (or the study's own MLflow run): its choice
        if values.get(name):
            try:
                value = str(values[name])
                if value.startswith("sqlite:///"):  # a SQLite ground truth is a file
                    values[name] = "sqlite:///" + policy.check_path(
                        name, value[len("sqlite:///"):])
                else:  # a path, or a URL (a database's too) under an allowed URL prefix
                    values[name] = policy.check_path(name, value)
            except ConfinementError as e:  # a database URL's password is not repeated
                message = re.sub(r"(://[^/:@\s]*):[^@/\s]*@", r"\1:***@", e.message)
                raise ConfinementError(e.field, f"{where}{message}") from None
    from pipetune.home import default_tracking_uri

    uri = values.get("tracking_uri")
    if uri and uri != default_tracking_uri():  # the worker's own default is its choice
        try:
            policy.check_tracking_uri("tracking_uri", uri)
        except ConfinementError as e:
            raise ConfinementError(e.field, f"{where}{e.message}") from None
