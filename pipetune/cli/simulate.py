"""``pipetune simulate JOB.yaml --times JOURNAL``: what a study would cost on a cluster.

The job's real engine (searcher, scheduler, system tuner, ground truth) runs over a
simulated cluster of ``--nodes`` x ``--cores-per-node`` cores, each epoch played from
the epochs a real study measured (``--times``: its journal, repeatable), under V1,
V2 and PipeTune (:mod:`pipetune.simulate`). It prints, per strategy, the tuning time
on the simulated clock, the core-hours and energy the epochs took, and the engine's
own milliseconds per decision; ``--json PATH`` writes all of it, each trial's
decisions included. Nothing is started: no Prefect, no Dask, no MLflow.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

_HEAD = (f"{'strategy':<14} {'trials':>6} {'at once':>7} {'epochs':>7} {'tuning s':>9} "
         f"{'core-h':>8} {'cluster-h':>9} {'energy kJ':>9} {'best':>7} {'engine ms/dec':>13} "
         f"{'searcher ms/ask':>15} {'groundtruth s':>13} {'wall s':>7}")


def _row(sim: Any) -> str:
    best = "-" if sim.best_value is None else f"{sim.best_value:.4g}"
    return (f"{sim.strategy:<14} {sim.trials:>6} {sim.peak_running:>7} {sim.epochs:>7} "
            f"{sim.tuning_s:>9.1f} "
            f"{sim.core_hours:>8.3f} {sim.cluster_hours:>9.3f} {sim.energy_j / 1000:>9.2f} "
            f"{best:>7} {sim.engine_ms_per_decision:>13.3f} "
            f"{sim.searcher_ms_per_proposal:>15.3f} {sim.groundtruth_s:>13.1f} "
            f"{sim.wall_s:>7.1f}")


def _say(sim: Any) -> None:
    print(_row(sim), flush=True)
    for line in sim.stand_ins:  # a config no journal measured: its times are another's
        print(f"  note: never measured: {line}")


def _positive(field: str, value: int | None) -> None:
    from pipetune.errors import PipetuneError

    if value is not None and value < 1:
        raise PipetuneError(f"{field}: must be an integer >= 1, got {value}")


def _job(args: argparse.Namespace) -> Any:
    from pipetune.spec import JobSpec, load_spec
    from pipetune.system.config import MachineInfo

    spec = load_spec(args.job)
    data = spec.to_dict()
    if args.trials is not None:
        data["search"]["trials"] = args.trials
    return JobSpec.from_dict(data, machine=MachineInfo(cores=args.cores_per_node))


def run_simulate(args: argparse.Namespace) -> int:
    from pipetune.errors import PipetuneError
    from pipetune.simulate import SIMULATED, Cluster, EpochTimes, simulate

    try:
        for field in ("nodes", "cores_per_node", "trials", "concurrent"):
            _positive(f"--{field.replace('_', '-')}", getattr(args, field))
        if args.gap_s is not None and args.gap_s < 0:
            raise PipetuneError(f"--gap-s: must be a number >= 0, got {args.gap_s}")
        unknown = [s for s in args.strategies if s not in SIMULATED]
        if unknown:
            raise PipetuneError(f"--strategy: unknown {', '.join(unknown)}; allowed: "
                                f"{', '.join(SIMULATED)}")
        spec = _job(args)
        times = EpochTimes.from_journals(args.times)
    except PipetuneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cluster = Cluster(args.nodes, args.cores_per_node)
    print(f"simulating {spec.name}: {spec.search.trials} trials on {cluster.nodes} nodes x "
          f"{cluster.cores_per_node} cores, epochs played from {len(times.records)} measured "
          f"epoch(s), {times.gap_s * 1000:.0f} ms between a trial's epochs")
    print(_HEAD)
    try:
        sims = simulate(spec, times, cluster, strategies=tuple(args.strategies) or SIMULATED,
                        concurrent=args.concurrent, gap_s=args.gap_s,
                        on_done=_say)
    except PipetuneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _compare(sims)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "job": spec.name, "nodes": cluster.nodes, "cores_per_node": cluster.cores_per_node,
            "gap_s": times.gap_s if args.gap_s is None else args.gap_s,
            "times": list(times.sources), "strategies": [s.to_dict() for s in sims]},
            default=str))  # compact: it holds every trial's decisions
        print(f"wrote {args.json}")
    return 0


def _compare(sims: list[Any]) -> None:
    """One line: each PipeTune run against the best V1/V2 strategy, as ratios."""
    by = {s.strategy: s for s in sims}
    others = [s for s in sims if not s.strategy.startswith("pipetune")]
    if not others:
        return
    fastest = min(others, key=lambda s: s.tuning_s)
    for name in ("pipetune-cold", "pipetune-warm"):
        if name in by and fastest.tuning_s > 0:
            p = by[name]
            print(f"{name} against {fastest.strategy} (the fastest other): tuning "
                  f"{p.tuning_s / fastest.tuning_s:.2f}x, core-hours "
                  f"{p.core_hours / max(fastest.core_hours, 1e-12):.2f}x, energy "
                  f"{p.energy_j / max(fastest.energy_j, 1e-12):.2f}x")


def add_simulate(subparsers: argparse._SubParsersAction) -> None:
    from pipetune.simulate.run import SIMULATED

    p = subparsers.add_parser(
        "simulate", help="what a study would cost on a simulated cluster",
        description="Run JOB.yaml's real engine over a simulated cluster, each epoch "
        "played from a real study's measured epochs (--times), under V1, V2 and PipeTune; "
        "print the tuning time, core-hours, energy and the engine's ms per decision.")
    p.add_argument("job", metavar="JOB.yaml")
    p.add_argument("--times", action="append", required=True, metavar="JOURNAL",
                   help="a study's journal ($PIPETUNE_HOME/studies/ID/events.jsonl or its "
                   "folder) whose epochs are played back; repeat for several")
    p.add_argument("--nodes", type=int, default=1, help="simulated nodes (default 1)")
    p.add_argument("--cores-per-node", type=int, default=32,
                   help="cores of each node (default 32); the system space is judged by one")
    p.add_argument("--trials", type=int, default=None, help="override search.trials")
    p.add_argument("--concurrent", type=int, default=None,
                   help="trials at once for every strategy (default: as many as the "
                   "cluster fits at each strategy's default cores)")
    p.add_argument("--gap-s", type=float, default=None,
                   help="seconds between a trial's epochs (default: the journals' median)")
    p.add_argument("--strategy", dest="strategies", action="append", default=[],
                   metavar="NAME", help=f"run only these (repeat); of {', '.join(SIMULATED)}")
    p.add_argument("--json", metavar="PATH", help="write every figure and decision here")
    p.set_defaults(run=run_simulate)
