"""What the bench measured: one :class:`StrategyResult` per strategy, the oracle's
rows, and the whole :class:`BenchResult` with its ratios, target checks and JSON form."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from pipetune.bench.jobs import OPTUNA_TARGET
from pipetune.bench.strategies import REFERENCE
from pipetune.spec import SYSTEM_HPARAM_PREFIX

if TYPE_CHECKING:
    from pipetune.engine.study import Study


@dataclass(frozen=True)
class StrategyResult:
    """What one strategy's study measured; or, with :attr:`failed` set, that it
    failed and why (:meth:`failure`: no figures, left out of every ratio)."""

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
    #: The overhead split as :func:`pipetune.reports.orchestration_overhead` splits it:
    #: task round trip, worker-side rebuild + checkpoint I/O, loop gap between epochs.
    overhead_parts_s: dict[str, float] = field(default_factory=dict)
    #: Wall time of the whole run as the user would wait for it: for optuna-plain its
    #: fresh process (interpreter start and imports included), for the studies the
    #: flow call (flow run created to summary returned; the shared cluster was warm).
    process_wall_s: float | None = None
    #: Why the strategy produced no result, in one line (None: it ran): the study's
    #: refusal or :class:`~pipetune.errors.BrokenWorkload`, the Optuna child's error.
    failed: str | None = None

    @classmethod
    def failure(cls, strategy: str, reason: str,
                study_run_id: str | None = None) -> StrategyResult:
        """A strategy that failed with ``reason`` (one line): every figure NaN or None,
        no epochs, no best trial.

        >>> StrategyResult.failure("v2", "ValueError: bad").best_value is None
        True
        """
        reason = " ".join(str(reason).split()) or "failed"
        return cls(
            strategy=strategy, tuning_wall_s=math.nan, best_value=None, best_params=None,
            chosen_system=None, epochs_run=0, probe_epochs=0, groundtruth_hits=0,
            groundtruth_lookups=0, energy_j=math.nan, energy_source="-",
            best_epoch_s_in_study=None, overhead_s=math.nan, compute_s=math.nan,
            overhead_median_s=math.nan, study_run_id=study_run_id, failed=reason,
        )

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
    #: Cores the config reserves: ``train_s x cores`` is what it costs a machine whose
    #: cores other trials wait for.
    cores: int = 1

    @property
    def core_s(self) -> float:
        return self.train_s * self.cores


def result_from_study(
    strategy: str, study: Study, wall_s: float, study_run_id: str | None = None
) -> StrategyResult:
    """Reduce a finished study to its :class:`StrategyResult`."""
    from pipetune.reports import orchestration_overhead

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


def result_from_optuna(result: Any, strategy: str = "optuna-plain") -> StrategyResult:
    """A :class:`StrategyResult` from :class:`pipetune.bench.optuna_plain.OptunaPlainResult`:
    no probes, no ground truth, no orchestration; energy not metered. A run whose every
    trial failed (Optuna records a trial that raises as ``FAIL`` and goes on) is a
    failed strategy, its reason the trials' most common error."""
    if result.trials and result.failed == result.trials:
        errors = Counter(row.error for row in result.rows if row.error)
        error = errors.most_common(1)[0][0] if errors else "no error recorded"
        return StrategyResult.failure(
            strategy, f"all {result.trials} trials failed: {error}")
    return StrategyResult(
        strategy=strategy,
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
            cores=trial.final_system.cores,
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

    def ran(self, strategy: str) -> StrategyResult | None:
        """``strategy``'s result when it ran; None when it is missing or failed (a
        failed strategy is never the other side of a ratio)."""
        s = self.get(strategy)
        return s if s is not None and s.failed is None else None

    @property
    def failed(self) -> list[StrategyResult]:
        """The strategies that failed, in the order they ran."""
        return [s for s in self.strategies if s.failed is not None]

    def training_s(self, strategy: str) -> float | None:
        """Full-epoch training time of the oracle's params under the config ``strategy``
        chose for its best trial (from the oracle's measurements)."""
        s = self.ran(strategy)
        if s is None or s.chosen_system is None:
            return None
        row = next((o for o in self.oracle if o.system == s.chosen_system), None)
        return row.train_s if row else None

    @property
    def oracle_best_s(self) -> float | None:
        return min((o.train_s for o in self.oracle), default=None)

    @staticmethod
    def per_epoch_s(s: StrategyResult) -> float | None:
        """Whole-process seconds per epoch trained: comparable where strategies train
        different numbers of epochs (early stopping, probes)."""
        if s.failed is not None or s.process_wall_s is None or not s.epochs_run:
            return None
        return s.process_wall_s / s.epochs_run

    @property
    def optuna_best_per_epoch(self) -> float | None:
        """The better of optuna-plain's and optuna-compiled's seconds per epoch (None
        when neither ran)."""
        runs = [self.per_epoch_s(s) for s in (self.ran("optuna-plain"),
                                              self.ran("optuna-compiled")) if s is not None]
        runs = [r for r in runs if r is not None]
        return min(runs) if runs else None

    def table(self) -> list[dict[str, Any]]:
        """One row per strategy with the ratios (``nan`` when a side is missing or
        failed); a failed strategy's row has its reason under ``failed`` and no figures."""
        ref = self.ran(REFERENCE)
        plain = self.ran("optuna-plain")
        ref_train = self.training_s(REFERENCE)
        oracle = self.oracle_best_s
        rows = []
        for s in self.strategies:
            if s.failed is not None:
                rows.append(_failed_row(s, self.metric))
                continue
            train = self.training_s(s.strategy)
            rows.append({
                "strategy": s.strategy,
                "failed": None,
                "tuning_wall_s": s.tuning_wall_s,
                "process_wall_s": s.process_wall_s,
                "tuning_vs_optuna": _ratio(s.tuning_wall_s,
                                           plain.tuning_wall_s if plain else None),
                "tuning_vs_v1": _ratio(s.tuning_wall_s, ref.tuning_wall_s if ref else None),
                "process_s_per_epoch": self.per_epoch_s(s),
                "per_epoch_vs_optuna_best": _ratio(self.per_epoch_s(s), self.optuna_best_per_epoch),
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
        """The issue's targets, each with what was measured and whether it is met. A
        target whose strategies ran but one side failed (for "the better Optuna
        strategy": every Optuna strategy that ran failed) is ``n/a``, measured
        ``<strategy> failed``."""
        out: list[dict[str, Any]] = []
        v1, cold = self.ran("v1-default"), self.ran("pipetune-cold")
        warm = self.ran("pipetune-warm")
        fixed = [s for s in (self.ran("v1-default"), self.ran("v1-one-core")) if s is not None]

        def add(name: str, measured: str, met: bool | None) -> None:
            out.append({"target": name, "measured": measured,
                        "met": "n/a" if met is None else ("yes" if met else "NO")})

        def present(*names: str) -> list[str]:
            return [n for n in names if self.get(n) is not None]

        def blocked(target: str, *sides: Sequence[str]) -> bool:
            """Add ``target`` as n/a when a side (strategies of which one is enough)
            is present and every strategy of it failed."""
            gone = [n for side in sides for n in side
                    if present(*side) and all(self.get(m).failed for m in present(*side))]
            if gone:
                add(target, f"{' and '.join(gone)} failed", None)
            return bool(gone)

        optuna = present("optuna-plain", "optuna-compiled")
        name = f"PipeTune cold tuning time <= {self.optuna_target:g} x optuna-plain"
        if (len(present("optuna-plain", "pipetune-cold")) == 2
                and not blocked(name, ["optuna-plain"], ["pipetune-cold"])):
            r = cold.tuning_wall_s / self.ran("optuna-plain").tuning_wall_s
            add(name, f"{r:.2f} x", r <= self.optuna_target)
        best_optuna = self.optuna_best_per_epoch
        for strategy, target in (("pipetune-cold", 1.0), ("pipetune-warm", 0.85)):
            name = (f"{strategy} s/epoch <= {target:g} x the better of optuna-plain and "
                    "optuna-compiled")
            if not present(strategy) or not optuna or blocked(name, [strategy], optuna):
                continue
            mine = self.per_epoch_s(self.ran(strategy))
            if mine is not None and best_optuna:
                r = mine / best_optuna
                add(name, f"{r:.2f} x", r <= target)
        name = "PipeTune warm <= 0.9 x PipeTune cold"
        if (len(present("pipetune-cold", "pipetune-warm")) == 2
                and not blocked(name, ["pipetune-cold"], ["pipetune-warm"])):
            r = warm.tuning_wall_s / cold.tuning_wall_s
            add(name, f"{r:.2f} x", r <= 0.9)
        for strategy in present("pipetune-cold", "pipetune-warm"):
            name = f"{strategy} tuning time <= 0.85 x v1-default"
            if present("v1-default") and not blocked(name, [strategy], ["v1-default"]):
                s = self.ran(strategy)
                r = s.tuning_wall_s / v1.tuning_wall_s
                add(name, f"{r:.2f} x", r <= 0.85)
        self._quality_targets(add, present, blocked, fixed)
        return out

    def _quality_targets(self, add: Callable[..., None], present: Callable[..., list[str]],
                         blocked: Callable[..., bool], fixed: list[StrategyResult]) -> None:
        """The targets on what PipeTune found (best value, chosen config against the
        oracle) and on its orchestration overhead, added by ``add`` (see :meth:`targets`)."""
        scale = 100.0 if self.metric == "accuracy" else 1.0
        v1_best = [s.best_value for s in fixed if s.best_value is not None]
        for strategy in present("pipetune-cold", "pipetune-warm"):
            name = f"{strategy} best {self.metric} within 0.5 points of V1"
            v1s = present("v1-default", "v1-one-core")
            if v1s and blocked(name, [strategy], v1s):
                continue
            s = self.ran(strategy)
            if s is None or s.best_value is None or not v1_best:
                continue
            ref = max(v1_best) if self.mode == "max" else min(v1_best)
            gap = (ref - s.best_value) * scale * (1 if self.mode == "max" else -1)
            side = "below" if gap > 0 else "above"
            add(name, f"{abs(gap):.2f} points {side} V1's best", gap <= 0.5)
        for strategy in present("pipetune-cold", "pipetune-warm"):
            name = f"{strategy} chosen config within 5% of the oracle"
            if blocked(name, [strategy]):
                continue
            s = self.ran(strategy)
            train, oracle = self.training_s(strategy), self.oracle_best_s
            if train is None or oracle is None:
                add(name, "not measured", None)
            else:
                r = train / oracle
                add(name, f"{r:.3f} x oracle [{s.chosen_system}]", r <= 1.05)
                # The oracle runs each config alone on an idle machine; a study that
                # runs trials side by side pays a config's cores too.
                row = next((o for o in self.oracle if o.system == s.chosen_system), None)
                best_core_s = min((o.core_s for o in self.oracle), default=None)
                if row is not None and best_core_s:
                    r = row.core_s / best_core_s
                    add(f"{strategy} chosen config within 5% of the oracle by core-seconds",
                        f"{r:.3f} x oracle's best core-seconds", r <= 1.05)
        shares = [s.overhead_share for s in self.strategies if not math.isnan(s.overhead_share)]
        if shares:
            worst = max(shares)
            add("orchestration overhead <= 10% of epoch time", f"max {worst:.1%} over strategies",
                worst <= 0.10)

    def to_json(self) -> dict[str, Any]:
        """The bench as ``results.json`` holds it: every field, plus the derived
        ``table`` and ``targets``."""
        data = asdict(self)
        data["table"] = self.table()
        data["targets"] = self.targets()
        return data


def _failed_row(s: StrategyResult, metric: str) -> dict[str, Any]:
    """A failed strategy's table row: its reason, every figure and ratio missing."""
    nan = math.nan
    return {
        "strategy": s.strategy, "failed": s.failed, "tuning_wall_s": nan,
        "process_wall_s": None, "tuning_vs_optuna": nan, "tuning_vs_v1": nan,
        "process_s_per_epoch": None, "per_epoch_vs_optuna_best": nan, f"best_{metric}": None,
        "epochs_run": None, "probe_epochs": None, "gt_hits": "-", "energy_j": nan,
        "energy_vs_v1": nan, "energy_source": "-", "chosen_system": "-", "train_s": None,
        "train_vs_v1": nan, "train_vs_oracle": nan, "overhead_share": nan,
    }


def _ratio(a: float | None, b: float | None) -> float:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b
