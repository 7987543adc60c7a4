"""Serve the deployments declared in ``deployments/prefect.yaml`` without a work pool.

``prefect deploy`` registers those deployments on a process work pool, for a worker
to run. This script registers the same ones (same names, parameters, schedules and
parameter-schema enforcement) and runs their flow runs itself, in subprocesses, until
stopped: one process instead of a pool and a worker. Run it from anywhere; flow runs
start in the repository root, as they do under ``prefect deploy``.

    python deployments/serve.py                 # every deployment in prefect.yaml
    python deployments/serve.py tiny-synthetic  # only these
    pipetune serve tiny-synthetic --limit 1     # the same, through the CLI

It needs a Prefect server (``PREFECT_API_URL``); see ``deployments/README.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = Path(__file__).resolve().with_name("prefect.yaml")

#: Environment the flow runs get on the work pool (prefect.yaml's job_variables.env);
#: set here too, unless already set, so served runs behave the same.
_RUN_ENV_KEY = ("work_pool", "job_variables", "env")


def load_declarations(path: str | Path = PREFECT_FILE) -> list[dict[str, Any]]:
    """The ``deployments`` entries of a prefect.yaml, YAML anchors resolved."""
    import yaml

    from pipetune.errors import PipetuneError

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise PipetuneError(f"no deployment file at {path}") from None
    declarations = data.get("deployments") or []
    if not isinstance(declarations, list) or not all(isinstance(d, dict) for d in declarations):
        raise PipetuneError(f"{path}: 'deployments' must be a list of mappings")
    return declarations


def select(declarations: list[dict[str, Any]], names: list[str] | None) -> list[dict[str, Any]]:
    """The declarations named in ``names`` (all when empty), in file order."""
    from pipetune.errors import SpecError

    if not names:
        return list(declarations)
    known = [d.get("name") for d in declarations]
    for name in names:
        if name not in known:
            raise SpecError("deployment", f"no deployment {name!r}; known: {', '.join(known)}")
    return [d for d in declarations if d.get("name") in names]


def _schedules(declaration: dict[str, Any]) -> list[Any]:
    from prefect.schedules import Cron, Interval

    out = []
    for s in declaration.get("schedules") or []:
        common = {"timezone": s.get("timezone"), "active": s.get("active", True)}
        if "cron" in s:
            out.append(Cron(s["cron"], **common))
        elif "interval" in s:
            out.append(Interval(s["interval"], **common))
        else:
            raise ValueError(f"deployment {declaration.get('name')!r}: a schedule needs "
                             f"cron or interval, got {s!r}")
    return out


def run_environment(declarations: list[dict[str, Any]]) -> dict[str, str]:
    """The ``job_variables.env`` the declarations give their flow runs, merged."""
    env: dict[str, str] = {}
    for d in declarations:
        value: Any = d
        for key in _RUN_ENV_KEY:
            value = value.get(key) if isinstance(value, dict) else None
        env.update({k: str(v) for k, v in (value or {}).items()})
    return env


def build_deployments(declarations: list[dict[str, Any]]) -> list[Any]:
    """``RunnerDeployment`` objects for ``declarations`` (loads each entrypoint's flow
    from the repository root)."""
    from prefect.flows import load_flow_from_entrypoint

    deployments = []
    for d in declarations:
        entrypoint = d["entrypoint"]
        path, _, name = entrypoint.partition(":")
        flow = load_flow_from_entrypoint(f"{REPO_ROOT / path}:{name}")
        deployments.append(
            flow.to_deployment(
                name=d["name"],
                description=d.get("description"),
                tags=d.get("tags"),
                parameters=d.get("parameters") or {},
                schedules=_schedules(d),
                enforce_parameter_schema=d.get("enforce_parameter_schema", True),
            )
        )
    return deployments


def require_api_url() -> str:
    """The configured Prefect API URL (environment or profile), checked to answer.

    Serving or streaming against Prefect's throwaway ephemeral server would record
    runs nobody else can see, so a configured, running server is required.
    """
    from prefect.settings import get_current_settings

    from pipetune.errors import PipetuneError
    from pipetune.prefect_server import healthy

    url = get_current_settings().api.url
    if not url:
        raise PipetuneError(
            "no Prefect server configured: start one with `prefect server start --host "
            "127.0.0.1` and run `prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api`"
            " (or export PREFECT_API_URL); see deployments/README.md"
        )
    url = str(url).rstrip("/")
    if not healthy(url, timeout=5.0):
        raise PipetuneError(f"the Prefect server at {url} does not answer (is it running?)")
    return url


def take_over(deployments: list[Any], *, replace: bool) -> list[str]:
    """Make room for serving ``deployments``: the same names registered on a work pool
    (by ``prefect deploy``) would keep their pool and storage settings and their runs
    would fail to load. Refuse, or with ``replace`` delete those registrations (their
    past flow runs stay). Returns the names deleted."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    from pipetune.errors import PipetuneError

    bound = []
    with get_client(sync_client=True) as client:
        for d in deployments:
            full = f"{d.flow_name}/{d.name}"
            try:
                existing = client.read_deployment_by_name(full)
            except ObjectNotFound:
                continue
            if existing.work_pool_name:
                bound.append((full, existing))
        if bound and not replace:
            names = ", ".join(f"'{full}'" for full, _ in bound)
            raise PipetuneError(
                f"{names} already registered on work pool "
                f"'{bound[0][1].work_pool_name}' (prefect deploy): run a worker for them, or "
                "serve with --replace to re-register them here (their past runs stay)"
            )
        for _, existing in bound:
            client.delete_deployment(existing.id)
    return [full for full, _ in bound]


def serve_deployments(names: list[str] | None = None, *, limit: int = 1,
                      replace: bool = False, path: str | Path = PREFECT_FILE) -> None:
    """Register and serve the named deployments (all by default) until stopped
    (Ctrl-C or SIGTERM).

    ``limit`` is how many flow runs may execute at once; 1 (the default) queues them,
    as the work pool's concurrency limit does: each study starts a Dask cluster sized
    to the whole machine. ``replace``: see :func:`take_over`.
    """
    from prefect import serve

    require_api_url()
    chosen = select(load_declarations(path), names)
    for key, value in run_environment(chosen).items():
        os.environ.setdefault(key, value)
    os.chdir(REPO_ROOT)  # served runs inherit it: job paths resolve as under a worker
    deployments = build_deployments(chosen)
    take_over(deployments, replace=replace)
    serve(*deployments, limit=limit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help="deployments to serve (default: all in prefect.yaml)")
    parser.add_argument("--limit", type=int, default=1,
                        help="flow runs executed at once (default 1)")
    parser.add_argument("--replace", action="store_true",
                        help="take over deployments of the same names from a work pool")
    args = parser.parse_args(argv)
    serve_deployments(args.names, limit=args.limit, replace=args.replace)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))  # run as a script from a checkout
    sys.exit(main())
