"""``pipetune bench JOB.yaml``: every tuning strategy on one job, side by side.

Like ``pipetune tune``, it starts a local Prefect server when ``PREFECT_API_URL`` is
not set, and imports ``flows.bench`` only once the job file has been read.

Exit codes: 0 every strategy ran; 1 some strategy failed (the others ran, the report is
written and names it with its reason); 2 a user error refused before starting.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from pipetune.errors import SpecError


def _strategies(text: str | None) -> list[str]:
    """The strategies to run: all of :data:`~pipetune.bench.STRATEGIES` by default, or
    those named (a peer such as ``ray-tune`` only when named). A peer whose library is
    not installed is left out with one line on stderr."""
    from pipetune.bench import PEERS, STRATEGIES, peer_unavailable

    if not text:
        return list(STRATEGIES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in STRATEGIES + PEERS:
            raise SpecError("--strategies", f"unknown strategy {n!r}; allowed: "
                            f"{', '.join(STRATEGIES + PEERS)}")
    kept = []
    for n in names:
        line = peer_unavailable(n)
        if line is None:
            kept.append(n)
        else:
            print(line, file=sys.stderr)
    if not kept:
        raise SpecError("--strategies", f"nothing left to run: {', '.join(names)} skipped")
    return kept


def run_bench_command(args: argparse.Namespace) -> int:
    from pipetune.bench import load_bench_job
    from pipetune.cli import quiet_defaults
    from pipetune.home import pipetune_home
    from pipetune.prefect_server import prefect_api
    from pipetune.tracking import default_tracking_uri, ensure_experiment

    strategies = _strategies(args.strategies)
    job = load_bench_job(args.job, quick=args.quick)
    suffix = "-quick" if args.quick else ""
    out = Path(args.out or Path("results") / f"bench-{job.spec.name}{suffix}")
    command = " ".join(
        ["pipetune bench", shlex.quote(args.job)]
        + (["--quick"] if args.quick else [])
        + (["--strategies", args.strategies] if args.strategies else [])
        + (["--no-oracle"] if args.no_oracle else [])
    )
    quiet_defaults()
    tracking_uri = args.tracking_uri or default_tracking_uri()
    print(f"bench {job.spec.name}: data {job.data}; results in {out}", file=sys.stderr)
    with prefect_api(pipetune_home() / "prefect-server.log"):
        ensure_experiment(tracking_uri)  # once, before any fan-out
        import flows.study  # noqa: F401 - Prefect sets its console handlers up on import
        from flows.bench import run_bench
        from pipetune.cli._console import quiet_flow_tracebacks

        # A strategy that fails is the bench's one line, not Prefect's engine traceback.
        with quiet_flow_tracebacks():
            bench, paths = run_bench(job, out_dir=out, tracking_uri=tracking_uri,
                                     command=command, strategies=strategies,
                                     oracle=not args.no_oracle)
        # Prefect's last logs and events go while its server is up (it stops with this
        # block); sent at exit, they ended the output with "Error logging to API".
        flows.study.drain_prefect()
    print(paths["markdown"].read_text(encoding="utf-8"))
    print(f"report: {out} (results.md, results.json, tuning_time.png, metric_vs_time.png)")
    print(f"MLflow: bench run {bench.bench_run_id} (experiment pipetune-bench) in {tracking_uri}")
    _print_links(bench, tracking_uri)
    if bench.failed:
        names = ", ".join(s.strategy for s in bench.failed)
        print(f"error: {len(bench.failed)} of {len(bench.strategies)} strategies failed "
              f"({names}); their reasons are in {paths['markdown']}", file=sys.stderr)
        return 1
    return 0


def _print_links(bench, tracking_uri: str) -> None:
    """The bench run's and each strategy's study run's pages in the MLflow UI."""
    from pipetune.bench import BENCH_EXPERIMENT
    from pipetune.tracking import DEFAULT_EXPERIMENT, default_tracking_uri, mlflow_client
    from pipetune.tracking.links import run_url, ui_base_url

    base = ui_base_url(tracking_uri)
    client = mlflow_client(tracking_uri)

    def experiment_id(name: str) -> str | None:
        try:
            found = client.get_experiment_by_name(name)
        except Exception:  # noqa: BLE001 - a link without its experiment still opens the run
            return None
        return found.experiment_id if found is not None else None

    served = tracking_uri.split(":", 1)[0].lower() in ("http", "https")
    ui = "pipetune ui" + ("" if tracking_uri == default_tracking_uri()
                          else f" --tracking-uri {shlex.quote(tracking_uri)}")
    if bench.bench_run_id:
        print(f"  open {run_url(base, bench.bench_run_id, experiment_id(BENCH_EXPERIMENT))}"
              + ("" if served else f" (start the UI first: {ui})"))
    studies = experiment_id(DEFAULT_EXPERIMENT)
    for s in bench.strategies:
        if s.study_run_id:
            print(f"  {s.strategy} study run: {run_url(base, s.study_run_id, studies)}")


def add_bench(subparsers: argparse._SubParsersAction) -> None:
    """Register ``pipetune bench``."""
    p = subparsers.add_parser(
        "bench", help="compare PipeTune with V1, V2 and the oracle on one job",
        description="Run V1 (default config; one core per trial), V2 (joint tuning), PipeTune "
        "cold and warm, then the oracle, with the same trial budget and seeds; write a "
        "markdown table and pictures, and log the bench to MLflow (experiment pipetune-bench).",
    )
    p.add_argument("job", metavar="JOB.yaml", help="a job file, optionally with a bench section")
    p.add_argument("--quick", action="store_true",
                   help="the job's bench.quick sizes (default: half the trials)")
    p.add_argument("--out", default=None,
                   help="results folder (default: results/bench-<job>[-quick])")
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow tracking URI (default: sqlite:///./mlflow.db)")
    p.add_argument("--strategies", default=None,
                   help="comma-separated subset, e.g. v1-default,pipetune-cold; "
                   "ray-tune (Ray Tune, the peers extra) runs only when named")
    p.add_argument("--no-oracle", action="store_true", help="skip the oracle runs")
    p.set_defaults(run=run_bench_command)
