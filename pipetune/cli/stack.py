"""``pipetune stack up|down|status|env``: the team stack (PostgreSQL, a Prefect server
and worker, an MLflow tracking server, a Dask scheduler and workers) in one folder, on
loopback unless ``--host`` says otherwise. See :mod:`pipetune.stack`."""

from __future__ import annotations

import argparse
import shlex
import sys


def _dir(args: argparse.Namespace):
    from pathlib import Path

    from pipetune.stack import default_dir

    return Path(args.dir).expanduser().absolute() if args.dir else default_dir()


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_stack(args: argparse.Namespace) -> int:
    return {"up": _up, "down": _down, "status": _status, "env": _env}[args.action](args)


def _up(args: argparse.Namespace) -> int:
    from pipetune.cli import quiet_defaults
    from pipetune.stack import env_lines, up

    quiet_defaults()
    directory = _dir(args)
    state = up(directory, host=args.host, workers=args.workers,
               cores_per_worker=args.cores_per_worker, timeout=args.timeout, echo=_progress)
    urls = state["urls"]
    print(f"stack running in {directory} (started in {state['startup_s']['total']:.1f} s)")
    print(f"  Prefect UI   {urls['prefect_ui']}   (work pool {state['work_pool']!r})")
    print(f"  MLflow       {urls['mlflow']}")
    print(f"  Dask         {urls['dask_scheduler']}   ({state['workers']} workers x "
          f"{state['cores_per_worker']} cores)")
    if urls.get("dask_dashboard"):
        print(f"  Dask UI      {urls['dask_dashboard']}")
    print(f"  PostgreSQL   {state['components'][0]['url']}   "
          f"(databases {', '.join(state['postgres']['databases'])})")
    _print_locks(state.get("doors") or {})
    print("to use it, export:")
    for line in env_lines(state):
        print(f"  {line}")
    quoted = shlex.quote(str(directory))
    print(f"or: eval \"$(pipetune stack env --dir {quoted})\"; stop it with "
          f"`pipetune stack down --dir {quoted}`")
    return 0


def _print_locks(doors: dict) -> None:
    """Which doors are locked; the keys are the user's own and are not printed."""
    locks = []
    if doors.get("dask_tls"):
        locks.append("Dask: TLS, client certificates signed by "
                     f"{doors['dask_tls']['tls_ca_file']}")
    if doors.get("mlflow_basic_auth"):
        locks.append(f"MLflow: basic auth (admin {doors['mlflow_basic_auth']!r}; clients set "
                     "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD)")
    if doors.get("prefect_auth_string"):
        locks.append("Prefect: auth string (clients set PREFECT_API_AUTH_STRING)")
    for line in locks:
        print(f"  locked       {line}")


def _down(args: argparse.Namespace) -> int:
    from pipetune.stack import down

    directory = _dir(args)
    done = down(directory, grace=args.grace, echo=_progress)
    if not done:
        print(f"no stack in {directory}")
        return 0
    left = [f"{name} (pid {pid})" for name, pid, stopped in done if not stopped]
    if left:
        print(f"still running after SIGKILL: {', '.join(left)}", file=sys.stderr)
        return 1
    print(f"stack in {directory} stopped ({len(done)} processes)")
    return 0


def _status(args: argparse.Namespace) -> int:
    from pipetune.stack import load, status

    directory = _dir(args)
    state = load(directory)
    if state is None:
        print(f"no stack in {directory}")
        return 1
    rows = status(directory)
    print(f"stack in {directory}: {state.get('state', '?')}, host {state.get('host')}")
    width = max(len(r.name) for r in rows) if rows else 10
    for r in rows:
        print(f"  {r.name:<{width}}  pid {r.pid or '-':<7}  "
              f"{'alive' if r.alive else 'DEAD ':<5}  {r.url or ''}")
    return 0 if rows and all(r.alive for r in rows) else 1


def _env(args: argparse.Namespace) -> int:
    from pipetune.errors import PipetuneError
    from pipetune.stack import env_lines, load, running

    directory = _dir(args)
    state = load(directory)
    if state is None or not state.get("env"):
        raise PipetuneError(f"no stack in {directory}; start one with `pipetune stack up`")
    if len(running(state)) < len(state.get("components", [])):
        print(f"# warning: the stack in {directory} is not (all) running; "
              "see `pipetune stack status`", file=sys.stderr)
    for line in env_lines(state):
        print(line)
    return 0


def add_stack(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "stack",
        help="start, stop or inspect the team stack (Prefect, MLflow, Dask, PostgreSQL)",
        description="The team stack in one folder: PostgreSQL, a Prefect server with a "
        "process worker on work pool 'pipetune', an MLflow tracking server (artifacts "
        "proxied), a Dask scheduler and workers. Each runs detached with its own log and "
        "PID file; bound to 127.0.0.1 unless --host says otherwise.",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    def with_dir(sub: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sub.add_argument("--dir", default=None,
                         help="the stack's folder (default: $PIPETUNE_HOME/stack, else "
                         "~/.pipetune/stack)")
        sub.set_defaults(run=run_stack)
        return sub

    u = with_dir(actions.add_parser(
        "up", help="start the stack and print the environment to use it",
        description="Start every component, each waited for until healthy; write "
        "stack.json (URLs, PIDs, start-up seconds) and print the environment to export. "
        "Exits 2 if a stack already runs in the folder. Locks, from the environment "
        "(see `pydoc pipetune.stack.doors`): PIPETUNE_DASK_TLS_CA_FILE/_CERT/_KEY put TLS "
        "with client certificates on Dask, MLFLOW_TRACKING_USERNAME/_PASSWORD basic auth on "
        "MLflow, PREFECT_API_AUTH_STRING an auth string on Prefect."))
    u.add_argument("--host", default="127.0.0.1",
                   help="address every component binds to (default 127.0.0.1; any other "
                   "address puts a password on PostgreSQL and exposes the rest unless locked: "
                   "see `pydoc pipetune.stack`)")
    u.add_argument("--workers", type=int, default=2, help="Dask workers (default 2)")
    u.add_argument("--cores-per-worker", type=int, default=1,
                   help="threads and `cores` resource of each Dask worker (default 1)")
    u.add_argument("--timeout", type=float, default=180.0,
                   help="seconds each component may take to become healthy (default 180)")
    d = with_dir(actions.add_parser(
        "down", help="stop every component, in reverse order",
        description="SIGTERM each component (PostgreSQL: a fast shutdown), SIGKILL after "
        "--grace seconds. Data and stack.json stay; a later `up` reuses them."))
    d.add_argument("--grace", type=float, default=10.0,
                   help="seconds before SIGKILL (default 10)")
    with_dir(actions.add_parser(
        "status", help="each component, its PID, alive or not, its URL",
        description="Exits 0 when every component runs, 1 otherwise."))
    with_dir(actions.add_parser(
        "env", help="print `export X=...` lines: eval \"$(pipetune stack env)\"",
        description="PREFECT_API_URL, MLFLOW_TRACKING_URI, PIPETUNE_DASK_ADDRESS, "
        "PIPETUNE_GROUNDTRUTH and PIPETUNE_CHECKPOINTS of the stack (with TLS on Dask, "
        "the PIPETUNE_DASK_TLS_* paths too; never a password), as shell export lines."))
