"""A study on a simulated cluster, under PipeTune and the strategies it is compared with.

:func:`simulate` runs the job's real engine (searcher, scheduler, system tuner, ground
truth) over a :class:`~pipetune.simulate.backend.SimulatedBackend` for each strategy
of :data:`SIMULATED` (their job-spec changes are the bench's,
:func:`pipetune.bench.strategies.strategy_spec`), and says what each would cost: the
tuning time on the simulated clock, the cores' hours and energy the epochs took, and
the engine's own wall seconds per decision (each finished epoch is one: stop, or
which config next).

On a cluster, a strategy runs as many trials at once as its default config fits
(``--concurrent`` sets it for all): V1's framework default holds a whole node per
trial, V1 one-core one core, V2 and PipeTune the job's default cores. ``pipetune-warm``
runs again with the ground truth the cold run left, as a recurring job does.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipetune.simulate.backend import SimulatedBackend
from pipetune.simulate.timing import Stopwatch, TimedGroundTruth, TimedSearcher

if TYPE_CHECKING:
    from pipetune.engine.study import Study
    from pipetune.simulate.times import EpochTimes
    from pipetune.spec import JobSpec

#: Strategies a simulation runs, in order (``pipetune-warm`` after ``pipetune-cold``).
SIMULATED: tuple[str, ...] = ("v1-default", "v1-one-core", "v2", "pipetune-cold",
                              "pipetune-warm")


@dataclass(frozen=True)
class Cluster:
    nodes: int
    cores_per_node: int

    @property
    def cores(self) -> int:
        return self.nodes * self.cores_per_node


@dataclass
class Simulated:
    """One strategy's simulated study."""

    strategy: str
    trials: int
    concurrent: int
    epochs: int
    tuning_s: float
    core_hours: float
    cluster_hours: float
    energy_j: float
    best_value: float | None
    best_params: dict[str, Any] | None
    probe_epochs: int
    groundtruth_hits: int
    peak_running: int
    mean_wait_s: float
    #: Wall seconds of this process: the engine's own (its policies included), and
    #: of those, the searcher's and the ground truth's.
    engine_s: float
    searcher_s: float
    groundtruth_s: float
    wall_s: float
    proposals: int = 0
    #: "config played as measured config: epochs", for configs no journal measured.
    stand_ins: list[str] = field(default_factory=list)
    #: Each trial: id, params, outcome, and per epoch its phase and system config.
    trial_rows: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def engine_ms_per_decision(self) -> float:
        """The engine's seconds per finished epoch (one decision each: stop, or which
        config next), the searcher's proposals and the ground truth's calls left out."""
        own = self.engine_s - self.searcher_s - self.groundtruth_s
        return 1000.0 * max(own, 0.0) / max(self.epochs, 1)

    @property
    def searcher_ms_per_proposal(self) -> float:
        return 1000.0 * self.searcher_s / max(self.proposals, 1)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {**asdict(self), "engine_ms_per_decision": self.engine_ms_per_decision,
                "searcher_ms_per_proposal": self.searcher_ms_per_proposal}


def strategy_job(name: str, spec: JobSpec, cluster: Cluster,
                 concurrent: int | None = None) -> JobSpec:
    """The job ``name`` runs on ``cluster`` (the bench's rewrite, at cluster scale)."""
    from pipetune.bench.strategies import strategy_spec
    from pipetune.spec import JobSpec
    from pipetune.system.config import MachineInfo

    node = MachineInfo(cores=cluster.cores_per_node)
    rewritten = strategy_spec(name.replace("pipetune-warm", "pipetune-cold"), spec, node)
    data = rewritten.to_dict()
    default_cores = max(rewritten.system.default.cores, 1)
    data["search"]["max_concurrent"] = concurrent or max(
        cluster.nodes * (cluster.cores_per_node // default_cores), 1)
    return JobSpec.from_dict(data, machine=node)


def simulate_one(name: str, spec: JobSpec, times: EpochTimes, cluster: Cluster, *,
                 ground_truth: TimedGroundTruth | None = None, concurrent: int | None = None,
                 gap_s: float | None = None) -> tuple[Simulated, Study]:
    """Run strategy ``name`` of ``spec`` on the simulated ``cluster``."""
    from pipetune.checkpoints import CheckpointStore
    from pipetune.engine.study import Study
    from pipetune.searchers import make_searcher
    from pipetune.system.config import MachineInfo

    job = strategy_job(name, spec, cluster, concurrent)
    times.stand_ins.clear()
    backend = SimulatedBackend(times.bind(job.hyperparameters), nodes=cluster.nodes,
                               cores_per_node=cluster.cores_per_node, gap_s=gap_s)
    watch = Stopwatch()
    searcher = TimedSearcher(make_searcher(
        job.search.algorithm, job.hyperparameters, mode=job.objective.mode,
        seed=job.search.seed, grid_points=job.search.grid_points), watch)
    if ground_truth is not None:
        ground_truth.watch = watch
    with tempfile.TemporaryDirectory(prefix="pipetune-sim-") as tmp:
        study = Study(job, study_id=f"sim-{name}", checkpoints=CheckpointStore(tmp),
                      ground_truth=ground_truth if job.pipetune.enabled else None,
                      core_budget=cluster.cores, searcher=searcher,
                      machine=MachineInfo(cores=cluster.cores_per_node))
        began = time.perf_counter()
        study.run(backend)
        wall = time.perf_counter() - began
    return _outcome(name, study, backend, cluster, wall, watch), study


def _outcome(name: str, study: Study, backend: SimulatedBackend, cluster: Cluster,
             wall: float, watch: Stopwatch) -> Simulated:
    summary, usage = study.summary(), backend.usage
    return Simulated(
        strategy=name, trials=summary.trials, concurrent=study.spec.search.max_concurrent,
        epochs=usage.epochs, tuning_s=backend.clock, core_hours=usage.core_s / 3600.0,
        cluster_hours=cluster.nodes * backend.clock / 3600.0, energy_j=usage.energy_j,
        best_value=summary.best_value, best_params=summary.best_params,
        probe_epochs=summary.probe_epochs, groundtruth_hits=summary.groundtruth_hits,
        peak_running=usage.peak_running,
        mean_wait_s=sum(usage.waited_s) / max(len(usage.waited_s), 1),
        engine_s=max(wall - usage.backend_wall_s, 0.0), searcher_s=watch.total("searcher."),
        groundtruth_s=watch.total("groundtruth."), wall_s=wall,
        proposals=watch.calls["searcher.ask"], trial_rows=trial_rows(study),
        stand_ins=[f"{a.label()} played as {b.label()}: {n} epoch(s)"
                   for (a, b), n in backend.times.stand_ins.items()])


def trial_rows(study: Study) -> list[dict[str, Any]]:
    """Each trial's decisions as the engine took them: its params, outcome, and each
    epoch's phase and system config (what the simulator is checked on)."""
    return [{"trial": t.trial_id, "params": t.params, "outcome": str(t.state),
             "epochs": [[str(r.phase), r.system.label()] for r in t.results]}
            for t in sorted(study.trials.values(), key=lambda t: t.trial_id)]


def simulate(spec: JobSpec, times: EpochTimes, cluster: Cluster, *,
             strategies: tuple[str, ...] = SIMULATED, concurrent: int | None = None,
             gap_s: float | None = None, on_done: Any = None) -> list[Simulated]:
    """Each strategy of ``strategies`` on ``cluster`` (module doc); ``on_done(sim)``
    hears each as it ends."""
    out = []
    with tempfile.TemporaryDirectory(prefix="pipetune-sim-gt-") as tmp:
        ground_truth = TimedGroundTruth(Path(tmp) / "groundtruth.db", Stopwatch())
        for name in strategies:
            sim, _ = simulate_one(name, spec, times, cluster, ground_truth=ground_truth,
                                  concurrent=concurrent, gap_s=gap_s)
            out.append(sim)
            if on_done is not None:
                on_done(sim)
    return out
