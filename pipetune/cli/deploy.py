"""``pipetune serve`` and ``pipetune stream``: the deployment side of the CLI.

``serve`` runs ``deployments/serve.py`` (the deployments of ``deployments/prefect.yaml``
without a work pool); ``stream`` submits a Poisson stream of tuning jobs to a
deployment and reports each job's queue wait, tuning time and response time. Both
talk to a running Prefect server (``PREFECT_API_URL``), and both import Prefect only
inside their ``run`` functions, after the options have been checked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipetune.cli import quiet_defaults
from pipetune.errors import SpecError

# -- serve ---------------------------------------------------------------------------


def run_serve(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise SpecError("--limit", f"must be an integer >= 1, got {args.limit}")
    quiet_defaults(quiet_logs=False)
    from deployments.serve import load_declarations, select, serve_deployments

    select(load_declarations(), args.names)  # a bad name fails before Prefect loads
    try:
        serve_deployments(args.names, limit=args.limit, replace=args.replace)
    except KeyboardInterrupt:
        return 0
    return 0


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="serve the deployments of deployments/prefect.yaml without a work pool",
        description="Register the deployments declared in deployments/prefect.yaml on the "
        "Prefect server (PREFECT_API_URL) and run their flow runs in this process's "
        "children until interrupted. Flow runs start in the repository root.",
    )
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="deployment names (default: all), e.g. tiny-synthetic")
    p.add_argument("--limit", type=int, default=1,
                   help="flow runs executed at once (default 1: each study uses the "
                   "whole machine)")
    p.add_argument("--replace", action="store_true",
                   help="re-register deployments of the same names that `prefect deploy` put "
                   "on a work pool (their past runs stay)")
    p.set_defaults(run=run_serve)


# -- stream --------------------------------------------------------------------------


def _check_stream_options(args: argparse.Namespace) -> None:
    if not args.rate > 0:
        raise SpecError("--rate", f"must be > 0 jobs per minute, got {args.rate}")
    if args.jobs < 1:
        raise SpecError("--jobs", f"must be an integer >= 1, got {args.jobs}")
    if args.trials is not None and args.trials < 1:
        raise SpecError("--trials", f"must be an integer >= 1, got {args.trials}")
    if args.timeout is not None and not args.timeout > 0:
        raise SpecError("--timeout", f"must be > 0 seconds, got {args.timeout}")
    if "/" not in args.deployment:
        raise SpecError("--deployment", f"must be FLOW/DEPLOYMENT, got {args.deployment!r}")


def run_stream(args: argparse.Namespace) -> int:
    from pipetune.spec import load_spec

    _check_stream_options(args)
    job_files = args.job or list(_default_jobs())
    for path in dict.fromkeys(job_files):
        load_spec(path)  # a bad job file fails here, before anything is submitted
    quiet_defaults(quiet_logs=False)
    from deployments.serve import require_api_url
    from flows.stream import stream_flow
    from pipetune.cli._console import quiet_flow_tracebacks

    api_url = require_api_url()
    modes = [False, True] if args.compare else [not args.no_pipetune]
    results = []
    for pipetune in modes:
        label = "with PipeTune" if pipetune else "without PipeTune"
        print(f"stream {label}: {args.jobs} jobs at {args.rate:g}/min (seed {args.seed}) "
              f"-> {args.deployment} on {api_url}", file=sys.stderr)
        with quiet_flow_tracebacks():  # a refusal inside the flow: one error: line
            results.append(stream_flow(
                job_files=job_files, rate_per_min=args.rate, jobs=args.jobs, seed=args.seed,
                deployment=args.deployment, pipetune=pipetune, trials=args.trials,
                tracking_uri=args.tracking_uri, groundtruth_path=args.groundtruth,
                timeout_s=args.timeout,
            ))
    _print_stream(results)
    failed = sum(r["summary"]["jobs"] - r["summary"]["completed"] for r in results)
    return 0 if failed == 0 else 1


def _default_jobs() -> tuple[str, ...]:
    from flows.stream import DEFAULT_JOBS

    return DEFAULT_JOBS


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _print_stream(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    jobs = Table(title="stream jobs (seconds)")
    for col in ("mode", "job", "file", "arrival", "queue wait", "tuning", "response",
                "probes", "gt hits", "state"):
        jobs.add_column(col)
    for result in results:
        for j in result["jobs"]:
            jobs.add_row(
                "pipetune" if j["pipetune"] else "no-pipetune", str(j["index"]),
                Path(j["job"]).name,
                _fmt(j["arrival_s"]), _fmt(j["queue_wait_s"]), _fmt(j["tuning_s"]),
                _fmt(j["response_s"]), _fmt(j["probe_epochs"], 0),
                _fmt(j["groundtruth_hits"], 0), j["state"],
            )
    console.print(jobs)
    summary = Table(title="response time = queue wait + tuning (means over completed jobs)")
    for col in ("mode", "completed", "queue wait", "tuning", "response", "p95 response",
                "probes", "gt hits"):
        summary.add_column(col)
    for result in results:
        s = result["summary"]
        summary.add_row(
            "pipetune" if result["jobs"] and result["jobs"][0]["pipetune"] else "no-pipetune",
            f"{int(s['completed'])}/{int(s['jobs'])}", _fmt(s.get("mean_queue_wait_s")),
            _fmt(s.get("mean_tuning_s")), _fmt(s.get("mean_response_s")),
            _fmt(s.get("p95_response_s")), _fmt(s.get("probe_epochs"), 0),
            _fmt(s.get("groundtruth_hits"), 0),
        )
    console.print(summary)


def _add_stream(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "stream", help="submit a Poisson stream of tuning jobs to a deployment",
        description="Submit --jobs tuning jobs to a deployment (a worker or `pipetune serve` "
        "runs them) with exponential gaps at --rate jobs per minute, all sharing one MLflow "
        "store and one ground truth, then report each job's queue wait, tuning time and "
        "response time as the Prefect server recorded them.",
    )
    p.add_argument("--rate", type=float, default=2.0, help="arrivals per minute (default 2)")
    p.add_argument("--jobs", type=int, default=6, help="number of jobs (default 6)")
    p.add_argument("--seed", type=int, default=0, help="seed of arrivals and job picks")
    p.add_argument("--job", action="append", metavar="JOB.yaml",
                   help="a job file to draw from (repeatable; default: the tiny examples "
                   "of three workloads)")
    p.add_argument("--deployment", default="pipetune-study/on-demand",
                   help="FLOW/DEPLOYMENT to submit to (default pipetune-study/on-demand)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--no-pipetune", action="store_true",
                      help="hyperparameters only: every epoch under the default config")
    mode.add_argument("--compare", action="store_true",
                      help="run the stream without PipeTune, then with it; one table")
    p.add_argument("--trials", type=int, default=None, help="override search.trials of every job")
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow store every job writes to (default: sqlite:///./mlflow.db)")
    p.add_argument("--groundtruth", default=None,
                   help="ground truth every job shares, a file or sqlite:// or postgresql:// "
                   "URL (default: the worker's $PIPETUNE_GROUNDTRUTH, else "
                   "$PIPETUNE_HOME/groundtruth.db)")
    p.add_argument("--timeout", type=float, default=None,
                   help="give up waiting after this many seconds")
    p.set_defaults(run=run_stream)


def add_deploy_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register ``serve`` and ``stream``."""
    for add in (_add_serve, _add_stream):
        add(subparsers)
