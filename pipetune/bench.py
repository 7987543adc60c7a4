"""``pipetune bench``: PipeTune against hyperparameter-only tuning, joint tuning and the oracle.

Pure logic, no Prefect: the strategies as job-spec transformations, the oracle plan,
the results table with its ratios and target checks, and the report (markdown, JSON,
pictures). ``flows/bench.py`` runs the studies; this module says what to run and
what the numbers mean.

Strategies, all with the job's hyperparameter space, trial budget and seeds:

=================  =====================================================================
``optuna-plain``   the user's alternative: a plain in-process Optuna study of the same
                   workload code (TPE + SuccessiveHalvingPruner from the job's ASHA
                   settings, ``n_jobs`` = cores, one torch thread each), in a fresh
                   process with no Prefect, Dask or MLflow (:mod:`pipetune.bench_optuna`)
``v1-default``     hyperparameters only; every epoch under the job's default config with
                   all of the machine's cores, one trial at a time (a framework default)
``v1-one-core``    hyperparameters only; one core per trial, as many trials at once as
                   the machine has cores (Ray Tune's default)
``v2``             joint tuning: each knob of ``system.space`` becomes a ``system.<knob>``
                   choice of the hyperparameter space, over :func:`system_axes` (the
                   space's values plus the default's, and for ``cores`` also 1 and all)
``pipetune-cold``  the job as written, PipeTune on, with an empty ground truth
``pipetune-warm``  the same again, with the ground truth the cold run left
``oracle``         the best hyperparameter config found, trained for the full epochs
                   under every system config of the space, one at a time
=================  =====================================================================

A bench job is a job file with one extra top-level section, ``bench`` (removed before
the job is validated)::

    bench:
      datasets: ../../../shared/datasets   # data root, relative to this file
      fallback: {dataset: digits, train_samples: 1200, val_samples: 400}
      quick: {trials: 4, max_epochs: 3, workload_params: {train_samples: 600}}

Relative ``workload.params.data_dir`` / ``path`` values are resolved against the data
root: ``$PIPETUNE_DATASETS`` when set, else ``bench.datasets`` relative to the job
file. When that path does not exist, ``bench.fallback`` replaces the workload's data
params (``dataset``, ``data_dir``, ``path`` and whatever it names), so the bench runs
on the workload's embedded data instead; the report says which data it used.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipetune.errors import SpecError
from pipetune.space import Choice
from pipetune.spec import SYSTEM_HPARAM_PREFIX, JobSpec
from pipetune.system.config import KNOBS, MachineInfo

if TYPE_CHECKING:
    from pipetune.study import Study

#: Tuning strategies in the order the bench runs them (the oracle comes last).
STRATEGIES: tuple[str, ...] = (
    "optuna-plain",
    "v1-default",
    "v1-one-core",
    "v2",
    "pipetune-cold",
    "pipetune-warm",
)
ORACLE = "oracle"
REFERENCE = "v1-default"
#: How each strategy uses the ground truth: none, a fresh (empty) one, or the cold run's.
GROUNDTRUTH_USE: dict[str, str] = {
    "optuna-plain": "none",
    "v1-default": "none",
    "v1-one-core": "none",
    "v2": "none",
    "pipetune-cold": "fresh",
    "pipetune-warm": "reuse",
}
_DATA_KEYS = ("dataset", "data_dir", "path")
_BENCH_KEYS = ("datasets", "fallback", "quick", "optuna_target")
#: Default target for pipetune-cold's tuning time as a multiple of optuna-plain's.
OPTUNA_TARGET = 1.05
_QUICK_KEYS = ("trials", "max_epochs", "workload_params")


# -- bench jobs -----------------------------------------------------------------------


@dataclass(frozen=True)
class BenchJob:
    """A bench job: the PipeTune job spec plus where its data came from."""

    spec: JobSpec
    path: str
    data: str
    quick: bool
    #: pipetune-cold's tuning time must be at most this multiple of optuna-plain's.
    optuna_target: float = OPTUNA_TARGET


def load_bench_job(
    path: str | Path,
    *,
    quick: bool = False,
    machine: MachineInfo | None = None,
    datasets: str | Path | None = None,
) -> BenchJob:
    """Read a bench job file (a job file with an optional ``bench`` section; see the
    module doc). ``datasets`` overrides the data root (default ``$PIPETUNE_DATASETS``,
    then ``bench.datasets``)."""
    import yaml

    from pipetune.spec import _Loader

    path = Path(path)
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)  # noqa: S506
    except FileNotFoundError:
        raise SpecError("", f"no such file: {path}") from None
    except yaml.YAMLError as e:
        raise SpecError("", f"invalid YAML in {path}: {e}") from None
    if not isinstance(data, dict):
        raise SpecError("", f"{path}: a job spec must be a mapping of sections")
    bench = data.pop("bench", None) or {}
    if not isinstance(bench, dict):
        raise SpecError("bench", "must be a mapping with datasets, fallback, quick")
    for key in bench:
        if key not in _BENCH_KEYS:
            raise SpecError(f"bench.{key}", f"unknown field; allowed: {', '.join(_BENCH_KEYS)}")
    root = datasets or os.environ.get("PIPETUNE_DATASETS") or bench.get("datasets")
    root_path = (path.parent / str(root)).resolve() if root is not None else None
    workload = dict(data.get("workload") or {})
    params = dict(workload.get("params") or {})
    params, note = resolve_data_params(params, root_path, bench.get("fallback"))
    workload["params"] = params
    data["workload"] = workload
    if quick:
        data = quick_overrides(data, bench.get("quick"))
    spec = JobSpec.from_dict(data, machine=machine)
    target = bench.get("optuna_target", OPTUNA_TARGET)
    if isinstance(target, bool) or not isinstance(target, int | float) or target <= 0:
        raise SpecError("bench.optuna_target", f"must be a number > 0, got {target!r}")
    return BenchJob(spec=spec, path=str(path), data=note, quick=quick,
                    optuna_target=float(target))


def resolve_data_params(
    params: Mapping[str, Any], root: Path | None, fallback: Mapping[str, Any] | None
) -> tuple[dict[str, Any], str]:
    """Workload params with relative data paths made absolute under ``root``; when a
    named path is missing, ``fallback`` replaces the data params. Returns the params
    and a note saying which data is used."""
    out = dict(params)
    named = {k: out[k] for k in ("data_dir", "path") if out.get(k) is not None}
    if not named:
        return out, f"{out.get('dataset', 'the workload default')} (embedded)"
    missing = []
    for key, value in named.items():
        p = Path(str(value)).expanduser()
        if not p.is_absolute():
            p = (root / p) if root is not None else p.resolve()
        out[key] = str(p)
        if not p.exists():
            missing.append(str(p))
    if not missing:
        return out, f"{out.get('dataset')} from {', '.join(out[k] for k in named)}"
    if fallback is None:
        raise SpecError(
            f"workload.params.{next(iter(named))}",
            f"{missing[0]} does not exist and the job has no bench.fallback",
        )
    if not isinstance(fallback, Mapping):
        raise SpecError("bench.fallback", "must be a mapping of workload params")
    out = {k: v for k, v in out.items() if k not in _DATA_KEYS}
    out.update(fallback)
    label = fallback.get("dataset", "the workload default")
    return out, f"{label} (embedded fallback: {missing[0]} not found)"


def quick_overrides(data: Mapping[str, Any], quick: Mapping[str, Any] | None) -> dict[str, Any]:
    """The job data with ``bench.quick`` applied: ``trials``, ``max_epochs`` and
    ``workload_params`` (merged over the job's). Without a ``quick`` section the
    trial budget is halved (at least 2)."""
    out = json.loads(json.dumps(data))
    quick = dict(quick or {})
    for key in quick:
        if key not in _QUICK_KEYS:
            raise SpecError(f"bench.quick.{key}",
                            f"unknown field; allowed: {', '.join(_QUICK_KEYS)}")
    search = out.setdefault("search", {})
    search["trials"] = quick.get("trials", max(2, int(search.get("trials", 2)) // 2))
    if "max_epochs" in quick:
        stopping = out.setdefault("early_stopping", {})
        stopping["max_epochs"] = quick["max_epochs"]
        stopping["min_epochs"] = min(int(stopping.get("min_epochs", 1)), quick["max_epochs"])
    if quick.get("workload_params"):
        out["workload"]["params"] = {**out["workload"].get("params", {}),
                                     **quick["workload_params"]}
    return out


# -- strategies as job-spec transformations -------------------------------------------


def _rebuild(spec: JobSpec, data: dict[str, Any], machine: MachineInfo | None) -> JobSpec:
    return JobSpec.from_dict(data, machine=machine)


def system_axes(spec: JobSpec, machine: MachineInfo) -> dict[str, list[Any]]:
    """Per knob of the job's system space, its values with the default's first, plus
    for ``cores`` the two V1 settings (1 and all of the machine's)."""
    axes: dict[str, list[Any]] = {}
    default = spec.system.default.to_dict()
    knobs = [k for k in KNOBS if k in spec.system.space or k == "cores"]
    for knob in knobs:
        values = [default[knob], *spec.system.space.get(knob, [])]
        if knob == "cores":
            values += [1, machine.cores]
        axes[knob] = [v for i, v in enumerate(values)
                      if not any(type(v) is type(w) and v == w for w in values[:i])]
    return axes


def strategy_spec(name: str, base: JobSpec, machine: MachineInfo) -> JobSpec:
    """The job spec strategy ``name`` runs (see the module doc); ``base`` is the
    PipeTune job as written."""
    data = base.to_dict()
    default = data["system"]["default"]
    if name == "optuna-plain":
        data["pipetune"]["enabled"] = False
        data["search"]["max_concurrent"] = machine.cores
    elif name == "v1-default":
        data["pipetune"]["enabled"] = False
        data["system"]["default"] = {**default, "cores": machine.cores}
        data["search"]["max_concurrent"] = 1
    elif name == "v1-one-core":
        data["pipetune"]["enabled"] = False
        data["system"]["default"] = {**default, "cores": 1}
        data["search"]["max_concurrent"] = machine.cores
    elif name == "v2":
        data["pipetune"]["enabled"] = False
        for knob, values in system_axes(base, machine).items():
            if knob == "cores" and knob not in base.system.space:
                continue
            data["hyperparameters"][f"{SYSTEM_HPARAM_PREFIX}{knob}"] = (
                Choice(tuple(values)).to_json()
            )
    elif name in ("pipetune-cold", "pipetune-warm"):
        data["pipetune"]["enabled"] = True
    else:
        raise SpecError("strategy", f"unknown strategy {name!r}; allowed: {', '.join(STRATEGIES)}")
    return _rebuild(base, data, machine)


def oracle_spec(base: JobSpec, params: Mapping[str, Any], machine: MachineInfo) -> JobSpec:
    """A grid study training ``params`` (hyperparameters; ``system.*`` entries are
    dropped) under every system config of :func:`system_axes`, each for the full
    ``max_epochs``, one at a time, no early stopping, PipeTune off."""
    data = base.to_dict()
    hp = {k: Choice((v,)).to_json() for k, v in sorted(params.items())
          if not k.startswith(SYSTEM_HPARAM_PREFIX)}
    axes = system_axes(base, machine)
    for knob, values in axes.items():
        hp[f"{SYSTEM_HPARAM_PREFIX}{knob}"] = Choice(tuple(values)).to_json()
    data["hyperparameters"] = hp
    data["pipetune"]["enabled"] = False
    data["search"].update({"algorithm": "grid", "trials": math.prod(map(len, axes.values())),
                           "max_concurrent": 1})
    data["early_stopping"] = {"policy": "none", "min_epochs": 1,
                              "max_epochs": base.early_stopping.max_epochs}
    return _rebuild(base, data, machine)


# -- results ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StrategyResult:
    """What one strategy's study measured."""

    strategy: str
    tuning_wall_s: float
    best_value: float | None
    best_params: dict[str, Any] | None
    chosen_system: str | None
    epochs_run: int
    probe_epochs: int
    groundtruth_hits: int
    groundtruth_lookups: int
    energy_j: float
    energy_source: str
    #: Mean training seconds per epoch of the best trial under its final config, as
    #: measured inside the study (shared machine, other trials running).
    best_epoch_s_in_study: float | None
    overhead_s: float
    compute_s: float
    overhead_median_s: float
    study_run_id: str | None = None
    #: The overhead split as :func:`pipetune.study.orchestration_overhead` splits it:
    #: task round trip, worker-side rebuild + checkpoint I/O, loop gap between epochs.
    overhead_parts_s: dict[str, float] = field(default_factory=dict)
    #: Wall time of the whole run as the user would wait for it: for optuna-plain its
    #: fresh process (interpreter start and imports included), for the studies the
    #: flow call (flow run created to summary returned; the shared cluster was warm).
    process_wall_s: float | None = None

    @property
    def overhead_share(self) -> float:
        """Orchestration time around the epochs / (that + the epochs' own compute)."""
        total = self.overhead_s + self.compute_s
        return self.overhead_s / total if total > 0 else math.nan


@dataclass(frozen=True)
class OracleRow:
    """One system config trained for the full epochs with the oracle's params."""

    system: str
    train_s: float
    epoch_s: float
    energy_j: float
    value: float | None


def result_from_study(
    strategy: str, study: Study, wall_s: float, study_run_id: str | None = None
) -> StrategyResult:
    """Reduce a finished study to its :class:`StrategyResult`."""
    from pipetune.study import orchestration_overhead

    summary = study.summary()
    best = study.best_trial()
    epoch_s = None
    if best is not None and best.final_system is not None:
        under = [r.measurement.wall_s for r in best.results if r.system == best.final_system]
        epoch_s = statistics.fmean(under) if under else None
    rows = orchestration_overhead(study)
    overheads = [r["overhead_s"] for r in rows if not math.isnan(r["overhead_s"])]
    return StrategyResult(
        strategy=strategy,
        tuning_wall_s=float(wall_s),
        best_value=summary.best_value,
        best_params=summary.best_params,
        chosen_system=summary.best_system.label() if summary.best_system else None,
        epochs_run=summary.epochs_run,
        probe_epochs=summary.probe_epochs,
        groundtruth_hits=summary.groundtruth_hits,
        groundtruth_lookups=summary.groundtruth_lookups,
        energy_j=summary.energy_j,
        energy_source=summary.energy_source,
        best_epoch_s_in_study=epoch_s,
        overhead_s=sum(overheads),
        compute_s=sum(r["compute_s"] for r in rows),
        overhead_median_s=statistics.median(overheads) if overheads else math.nan,
        study_run_id=study_run_id,
        overhead_parts_s={
            part: sum(r[part] for r in rows if not math.isnan(r[part]))
            for part in ("round_trip_s", "worker_extra_s", "loop_gap_s")
        },
    )


def result_from_optuna(result: Any) -> StrategyResult:
    """A :class:`StrategyResult` from :class:`pipetune.bench_optuna.OptunaPlainResult`:
    no probes, no ground truth, no orchestration; energy not metered."""
    return StrategyResult(
        strategy="optuna-plain",
        tuning_wall_s=float(result.tuning_wall_s),
        best_value=result.best_value,
        best_params=result.best_params,
        chosen_system=None,
        epochs_run=result.epochs_run,
        probe_epochs=0,
        groundtruth_hits=0,
        groundtruth_lookups=0,
        energy_j=math.nan,
        energy_source="not metered",
        best_epoch_s_in_study=None,
        overhead_s=math.nan,
        compute_s=math.nan,
        overhead_median_s=math.nan,
        process_wall_s=float(result.process_wall_s),
    )


def oracle_rows(study: Study) -> list[OracleRow]:
    """Per system config of an oracle study: full-epoch training time, fastest first."""
    rows = []
    for trial in study.trials.values():
        if not trial.results or trial.final_system is None:
            continue
        train = [r.measurement.wall_s for r in trial.results]
        rows.append(OracleRow(
            system=trial.final_system.label(),
            train_s=sum(train),
            epoch_s=statistics.fmean(train),
            energy_j=sum(r.measurement.energy_j for r in trial.results),
            value=trial.last_value(study.metric),
        ))
    return sorted(rows, key=lambda r: r.train_s)


def best_params_overall(results: Sequence[StrategyResult], mode: str) -> dict[str, Any] | None:
    """The hyperparameters (``system.*`` dropped) of the best trial over all strategies;
    ties go to the strategy listed first."""
    scored = [r for r in results if r.best_value is not None and r.best_params is not None]
    if not scored:
        return None
    sign = 1.0 if mode == "max" else -1.0
    best = max(enumerate(scored), key=lambda ir: (sign * ir[1].best_value, -ir[0]))[1]
    return {k: v for k, v in best.best_params.items() if not k.startswith(SYSTEM_HPARAM_PREFIX)}


@dataclass
class BenchResult:
    """A whole bench: what ran where, each strategy's result and the oracle table."""

    job: str
    metric: str
    mode: str
    data: str
    quick: bool
    machine: str
    command: str
    date: str
    strategies: list[StrategyResult]
    oracle: list[OracleRow] = field(default_factory=list)
    oracle_params: dict[str, Any] | None = None
    oracle_wall_s: float | None = None
    bench_wall_s: float | None = None
    bench_run_id: str | None = None
    optuna_target: float = OPTUNA_TARGET

    def get(self, strategy: str) -> StrategyResult | None:
        return next((s for s in self.strategies if s.strategy == strategy), None)

    def training_s(self, strategy: str) -> float | None:
        """Full-epoch training time of the oracle's params under the config ``strategy``
        chose for its best trial (from the oracle's measurements)."""
        s = self.get(strategy)
        if s is None or s.chosen_system is None:
            return None
        row = next((o for o in self.oracle if o.system == s.chosen_system), None)
        return row.train_s if row else None

    @property
    def oracle_best_s(self) -> float | None:
        return min((o.train_s for o in self.oracle), default=None)

    def table(self) -> list[dict[str, Any]]:
        """One row per strategy with the ratios (``nan`` when a side is missing)."""
        ref = self.get(REFERENCE)
        plain = self.get("optuna-plain")
        ref_train = self.training_s(REFERENCE)
        oracle = self.oracle_best_s
        rows = []
        for s in self.strategies:
            train = self.training_s(s.strategy)
            rows.append({
                "strategy": s.strategy,
                "tuning_wall_s": s.tuning_wall_s,
                "process_wall_s": s.process_wall_s,
                "tuning_vs_optuna": _ratio(s.tuning_wall_s,
                                           plain.tuning_wall_s if plain else None),
                "tuning_vs_v1": _ratio(s.tuning_wall_s, ref.tuning_wall_s if ref else None),
                f"best_{self.metric}": s.best_value,
                "epochs_run": s.epochs_run,
                "probe_epochs": s.probe_epochs,
                "gt_hits": f"{s.groundtruth_hits}/{s.groundtruth_lookups}",
                "energy_j": s.energy_j,
                "energy_vs_v1": _ratio(s.energy_j, ref.energy_j if ref else None),
                "energy_source": s.energy_source,
                "chosen_system": s.chosen_system or "-",
                "train_s": train,
                "train_vs_v1": _ratio(train, ref_train),
                "train_vs_oracle": _ratio(train, oracle),
                "overhead_share": s.overhead_share,
            })
        return rows

    def targets(self) -> list[dict[str, Any]]:
        """The issue's targets, each with what was measured and whether it is met."""
        out: list[dict[str, Any]] = []
        v1, cold = self.get("v1-default"), self.get("pipetune-cold")
        warm = self.get("pipetune-warm")
        fixed = [s for s in (self.get("v1-default"), self.get("v1-one-core")) if s is not None]

        def add(name: str, measured: str, met: bool | None) -> None:
            out.append({"target": name, "measured": measured,
                        "met": "n/a" if met is None else ("yes" if met else "NO")})

        plain = self.get("optuna-plain")
        if plain and cold:
            r = cold.tuning_wall_s / plain.tuning_wall_s
            add(f"PipeTune cold tuning time <= {self.optuna_target:g} x optuna-plain",
                f"{r:.2f} x", r <= self.optuna_target)
        if cold and warm:
            r = warm.tuning_wall_s / cold.tuning_wall_s
            add("PipeTune warm <= 0.9 x PipeTune cold", f"{r:.2f} x", r <= 0.9)
        for s in (cold, warm):
            if v1 and s:
                r = s.tuning_wall_s / v1.tuning_wall_s
                add(f"{s.strategy} tuning time <= 0.85 x v1-default", f"{r:.2f} x", r <= 0.85)
        scale = 100.0 if self.metric == "accuracy" else 1.0
        v1_best = [s.best_value for s in fixed if s.best_value is not None]
        for s in (cold, warm):
            if s is None or s.best_value is None or not v1_best:
                continue
            ref = max(v1_best) if self.mode == "max" else min(v1_best)
            gap = (ref - s.best_value) * scale * (1 if self.mode == "max" else -1)
            side = "below" if gap > 0 else "above"
            add(f"{s.strategy} best {self.metric} within 0.5 points of V1",
                f"{abs(gap):.2f} points {side} V1's best", gap <= 0.5)
        for s in (cold, warm):
            train, oracle = (self.training_s(s.strategy) if s else None), self.oracle_best_s
            if s is None:
                continue
            if train is None or oracle is None:
                add(f"{s.strategy} chosen config within 5% of the oracle", "not measured", None)
            else:
                r = train / oracle
                add(f"{s.strategy} chosen config within 5% of the oracle",
                    f"{r:.3f} x oracle [{s.chosen_system}]", r <= 1.05)
        shares = [s.overhead_share for s in self.strategies if not math.isnan(s.overhead_share)]
        if shares:
            worst = max(shares)
            add("orchestration overhead <= 10% of epoch time", f"max {worst:.1%} over strategies",
                worst <= 0.10)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BenchResult:
        """Read back what :meth:`to_json` wrote (``table`` and ``targets`` are derived)."""
        fields = {k: v for k, v in data.items() if k not in ("table", "targets")}
        fields["strategies"] = [StrategyResult(**s) for s in data["strategies"]]
        fields["oracle"] = [OracleRow(**o) for o in data.get("oracle", [])]
        return cls(**fields)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["table"] = self.table()
        data["targets"] = self.targets()
        return data


def _ratio(a: float | None, b: float | None) -> float:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


# -- the report -------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.{digits}f}"
    return str(value)


def markdown(bench: BenchResult) -> str:
    """The bench as markdown: setup, strategy table, oracle table, targets."""
    lines = [
        f"### {bench.job}{' (quick)' if bench.quick else ''}",
        "",
        f"- date: {bench.date}",
        f"- machine: {bench.machine}",
        f"- command: `{bench.command}`",
        f"- data: {bench.data}",
    ]
    if bench.bench_wall_s is not None:
        lines.append(f"- whole bench wall time: {bench.bench_wall_s:.0f} s")
    if bench.bench_run_id:
        lines.append(f"- MLflow bench run: `{bench.bench_run_id}` (experiment `pipetune-bench`)")
    lines += ["", "| strategy | tuning s | process s | vs optuna | vs V1 | best " + bench.metric
              + " | epochs | probes | GT hits | energy J | vs V1 | chosen system | train s "
              "| vs V1 | vs oracle | overhead |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for row in bench.table():
        lines.append(
            "| {strategy} | {t} | {ps} | {tp} | {tr} | {m} | {e} | {p} | {gt} | {en} ({src}) "
            "| {er} | {sys} | {ts} | {tv} | {to} | {oh} |".format(
                strategy=row["strategy"], t=_fmt(row["tuning_wall_s"], 1),
                ps=_fmt(row["process_wall_s"], 1), tp=_fmt(row["tuning_vs_optuna"]),
                tr=_fmt(row["tuning_vs_v1"]), m=_fmt(row[f"best_{bench.metric}"], 4),
                e=row["epochs_run"], p=row["probe_epochs"], gt=row["gt_hits"],
                en=_fmt(row["energy_j"], 0), src=row["energy_source"],
                er=_fmt(row["energy_vs_v1"]), sys=row["chosen_system"],
                ts=_fmt(row["train_s"], 1), tv=_fmt(row["train_vs_v1"]),
                to=_fmt(row["train_vs_oracle"]),
                oh=f"{row['overhead_share']:.1%}" if not math.isnan(row["overhead_share"]) else "-",
            )
        )
    lines += ["", "Orchestration overhead (seconds summed over epochs; share = overhead / "
              "(overhead + epoch compute)):", "",
              "| strategy | epoch compute s | overhead s | median per epoch s | round trip s "
              "| worker rebuild + checkpoint s | loop gap s | share |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in bench.strategies:
        parts = s.overhead_parts_s
        lines.append(
            f"| {s.strategy} | {_fmt(s.compute_s, 1)} | {_fmt(s.overhead_s, 1)} | "
            f"{_fmt(s.overhead_median_s)} | {_fmt(parts.get('round_trip_s'), 1)} | "
            f"{_fmt(parts.get('worker_extra_s'), 1)} | {_fmt(parts.get('loop_gap_s'), 1)} | "
            + (f"{s.overhead_share:.1%} |" if not math.isnan(s.overhead_share) else "- |")
        )
    if bench.oracle:
        lines += ["", f"Oracle: params {json.dumps(bench.oracle_params, sort_keys=True)}, "
                  f"each config alone for the full epochs"
                  + (f" ({bench.oracle_wall_s:.0f} s)" if bench.oracle_wall_s else "") + ":", "",
                  f"| system | train s | s/epoch | energy J | {bench.metric} |",
                  "|---|---:|---:|---:|---:|"]
        for o in bench.oracle:
            lines.append(f"| {o.system} | {o.train_s:.1f} | {o.epoch_s:.2f} | {o.energy_j:.0f} "
                         f"| {_fmt(o.value, 4)} |")
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    for t in bench.targets():
        lines.append(f"| {t['target']} | {t['measured']} | {t['met']} |")
    return "\n".join(lines) + "\n"


def tuning_time_figure(bench: BenchResult):
    """Bar chart: tuning wall time per strategy (oracle's grid shown for scale)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.5))
    ax = fig.add_subplot()
    names = [s.strategy for s in bench.strategies]
    values = [s.tuning_wall_s for s in bench.strategies]
    bars = ax.bar(names, values, color=["#888" if n.startswith("v") else "#1f77b4" for n in names])
    for bar, v in zip(bars, values, strict=True):
        ax.annotate(f"{v:.0f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom",
                    fontsize=8)
    ax.set_ylabel("tuning wall time (s)")
    ax.set_title(f"{bench.job}: tuning time per strategy")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    return fig


def metric_time_figure(bench: BenchResult):
    """Scatter: best metric reached against tuning wall time, one point per strategy."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    markers = "osD^v<>"
    for i, s in enumerate(bench.strategies):
        if s.best_value is not None:
            # A legend, not labels: strategies often reach the same metric at similar times.
            ax.scatter([s.tuning_wall_s], [s.best_value], s=50, marker=markers[i % len(markers)],
                       label=s.strategy, alpha=0.8)
    if ax.collections:
        ax.legend(fontsize=8, loc="best")
    ax.set_xlabel("tuning wall time (s)")
    ax.set_ylabel(f"best {bench.metric}")
    ax.set_title(f"{bench.job}: best {bench.metric} vs tuning time")
    fig.tight_layout()
    return fig


def write_report(bench: BenchResult, out_dir: str | Path) -> dict[str, Path]:
    """Write ``results.md``, ``results.json``, ``tuning_time.png`` and
    ``metric_vs_time.png`` to ``out_dir``; returns the paths by kind."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "markdown": out / "results.md",
        "json": out / "results.json",
        "tuning_time": out / "tuning_time.png",
        "metric_vs_time": out / "metric_vs_time.png",
    }
    paths["markdown"].write_text(markdown(bench), encoding="utf-8")
    paths["json"].write_text(json.dumps(bench.to_json(), indent=2, default=str), encoding="utf-8")
    tuning_time_figure(bench).savefig(paths["tuning_time"], dpi=110)
    metric_time_figure(bench).savefig(paths["metric_vs_time"], dpi=110)
    return paths


def machine_description(machine: MachineInfo | None = None) -> str:
    """``"2 cores (Intel(R) Xeon ...), 0 CUDA devices, Linux 6.x"``."""
    import platform

    machine = machine or MachineInfo.detect()
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{machine.cores} cores ({model or 'unknown CPU'}), {machine.cuda_devices} CUDA "
            f"devices, {platform.system()} {platform.release()}")


# -- MLflow -----------------------------------------------------------------------------

#: Experiment the bench parent run and its per-strategy child runs are filed under.
BENCH_EXPERIMENT = "pipetune-bench"


class BenchTracker:
    """The bench in MLflow: one parent run holding the comparison, one child run per
    strategy. Each strategy's own study run (experiment ``pipetune``) is linked both
    ways: tag ``pipetune.bench_run_id`` on the study run, ``pipetune.study_run_id`` on
    the strategy's child run."""

    def __init__(self, tracking_uri: str, job: BenchJob, *, command: str):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        from pipetune.tracking import ensure_experiment

        self.client = MlflowClient(tracking_uri)
        self.experiment_id = ensure_experiment(tracking_uri, BENCH_EXPERIMENT)
        run = self.client.create_run(
            self.experiment_id,
            run_name=f"bench-{job.spec.name}{'-quick' if job.quick else ''}",
            tags={"pipetune.kind": "bench", "pipetune.job": job.spec.name},
        )
        self.run_id: str = run.info.run_id
        self.client.log_batch(self.run_id, params=[
            Param("job", job.spec.name), Param("job_file", job.path),
            Param("quick", str(job.quick)), Param("data", job.data[:500]),
            Param("command", command[:500]), Param("machine", machine_description()[:500]),
        ])
        self.client.log_dict(self.run_id, job.spec.to_dict(), "job.json")

    def log_strategy(self, result: StrategyResult, spec: JobSpec) -> str:
        """A child run for one strategy's result; tags its study run with this bench."""
        import time

        from mlflow.entities import Metric, Param

        tags = {"mlflow.parentRunId": self.run_id, "pipetune.kind": "bench-strategy",
                "pipetune.strategy": result.strategy}
        if result.study_run_id:
            tags["pipetune.study_run_id"] = result.study_run_id
            self.client.set_tag(result.study_run_id, "pipetune.bench_run_id", self.run_id)
            self.client.set_tag(result.study_run_id, "pipetune.bench_strategy", result.strategy)
        run = self.client.create_run(self.experiment_id, run_name=result.strategy, tags=tags)
        ts = int(time.time() * 1000)
        values = {
            "tuning_wall_s": result.tuning_wall_s, "epochs_run": result.epochs_run,
            "probe_epochs": result.probe_epochs, "groundtruth_hits": result.groundtruth_hits,
            "energy_j": result.energy_j, "overhead_share": result.overhead_share,
            "overhead_median_s": result.overhead_median_s,
        }
        if result.best_value is not None:
            values["best_value"] = result.best_value
        if result.process_wall_s is not None:
            values["process_wall_s"] = result.process_wall_s
        if result.best_epoch_s_in_study is not None:
            values["best_epoch_s_in_study"] = result.best_epoch_s_in_study
        params = [Param("system.default", spec.system.default.label()),
                  Param("pipetune.enabled", str(spec.pipetune.enabled)),
                  Param("search.max_concurrent", str(spec.search.max_concurrent)),
                  Param("chosen_system", result.chosen_system or "-"),
                  Param("energy_source", result.energy_source)]
        self.client.log_batch(
            run.info.run_id,
            metrics=[Metric(k, float(v), ts, 0) for k, v in values.items()
                     if not math.isnan(float(v))],
            params=params,
        )
        self.client.set_terminated(run.info.run_id)
        return run.info.run_id

    def finish(self, bench: BenchResult, paths: Mapping[str, Path], failed: bool = False) -> None:
        """The comparison on the parent run: per-strategy metrics and ratios, the
        report files as artifacts."""
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        metrics = []
        for row in bench.table():
            for key in ("tuning_wall_s", "tuning_vs_v1", "energy_vs_v1", "train_s",
                        "train_vs_v1", "train_vs_oracle", "overhead_share"):
                v = row[key]
                if v is not None and not math.isnan(float(v)):
                    metrics.append(Metric(f"{row['strategy']}.{key}", float(v), ts, 0))
            v = row[f"best_{bench.metric}"]
            if v is not None:
                metrics.append(Metric(f"{row['strategy']}.best_value", float(v), ts, 0))
        if bench.oracle_best_s is not None:
            metrics.append(Metric("oracle.best_train_s", bench.oracle_best_s, ts, 0))
        if bench.bench_wall_s is not None:
            metrics.append(Metric("bench_wall_s", bench.bench_wall_s, ts, 0))
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)
        for path in paths.values():
            self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")

    def fail(self) -> None:
        self.client.set_terminated(self.run_id, status="FAILED")
