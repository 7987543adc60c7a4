"""How a study's MLflow record names and shapes what it writes: the study run's params and
files, each epoch's metrics and tags, each ended trial's, the study's metric names
(``study_<key>``), the epochs' ``phase_code``, a trial's start time and its phases as
runs (``profile, probe x2, train x3``), the per-epoch profile table, and times in
milliseconds as MLflow keeps them."""

from __future__ import annotations

import json
import math
import time
from typing import TYPE_CHECKING, Any

from pipetune.errors import refused_by_store
from pipetune.states import Phase

if TYPE_CHECKING:
    from pipetune.engine.trial import Trial
    from pipetune.runner import EpochResult
    from pipetune.spec import JobSpec

#: Every metric of the study's (parent) run is named with this prefix: the summary's
#: ``energy_j`` is ``study_energy_j`` there, so no study-level figure shares a name, and
#: so a chart, with a per-trial metric (the trials' ``energy_j`` per epoch).
STUDY_METRIC_PREFIX = "study_"

#: Metric ``phase_code`` of a trial run, per epoch: its phase as a number a chart can
#: plot (the tag ``epoch.NNN.phase`` names it).
PHASE_CODES: dict[Phase, int] = {Phase.PROFILE: 0, Phase.PROBE: 1, Phase.TRAIN: 2}


def study_metric_name(key: str) -> str:
    """The name of the study summary's ``key`` on the study's MLflow run.

    >>> study_metric_name("energy_j"), study_metric_name("best_checkpoint_accuracy")
    ('study_energy_j', 'study_best_checkpoint_accuracy')
    """
    return key if key.startswith(STUDY_METRIC_PREFIX) else STUDY_METRIC_PREFIX + key


def _ms_floor(t: float) -> int:
    return math.floor(t * 1000)


def _ms_ceil(t: float) -> int:
    return math.ceil(t * 1000)


def trial_started(trial: Trial) -> float:
    """When ``trial``'s run starts: its first epoch's start on its worker, the workload
    built and its checkpoint loaded, so the run's duration covers its epochs (a worker
    starting, the workload's build, a wait for a free slot before it are the trial's
    ``startup_s``: :func:`startup_s`); the engine's ``started`` (or now) before any
    epoch ran."""
    if trial.results:
        first = trial.results[0]
        return first.started + first.setup_s
    return trial.started if trial.started is not None else time.time()


def startup_s(trial: Trial) -> float | None:
    """Seconds from the trial's start in the engine to its first epoch's start on its
    worker (:func:`trial_started`): a worker starting (importing torch), the workload's
    build (its module, its data), a wait for a free slot; None before its first epoch,
    or where the two clocks disagree."""
    if not trial.results or trial.started is None:
        return None
    wait = trial_started(trial) - trial.started
    return wait if wait >= 0 else None


def phase_runs(trial: Trial) -> str:
    """The phases of ``trial``'s epochs in order, as runs: ``profile, probe x2, train x3``."""
    runs: list[list[Any]] = []
    for r in trial.results:
        if runs and runs[-1][0] == r.phase.value:
            runs[-1][1] += 1
        else:
            runs.append([r.phase.value, 1])
    return ", ".join(p if n == 1 else f"{p} x{n}" for p, n in runs)


def profile_rows(trial: Trial) -> list[dict[str, Any]]:
    """One row per epoch: phase, system config and every profile feature."""
    rows: list[dict[str, Any]] = []
    for r in trial.results:
        m = r.measurement
        rows.append({
            "epoch": r.epoch,
            "phase": r.phase.value,
            "system": r.system.label(),
            "wall_s": m.wall_s,
            "samples_per_s": m.samples_per_s,
            "energy_j": m.energy_j,
            "energy_source": m.energy_source,
            "counters_source": m.counters_source,
            **m.profile.features,
        })
        if r.phase.value != "profile":  # the operator mix is sampled in the profiled epoch only
            rows[-1].update({k: None for k in m.profile.features if k.startswith("op_")})
    return rows


#: Metrics, params and tags as the sink takes them: ``(key, value, step, ms)``,
#: ``(key, value)`` and ``(key, value)``.
Metrics = list[tuple[str, float, int, int]]
Pairs = list[tuple[str, str]]


def study_params(spec: JobSpec) -> Pairs:
    """The study run's params: the job as the runs table shows it."""
    return [
        ("job", spec.name),
        ("workload", spec.workload.name),
        ("search.algorithm", spec.search.algorithm),
        ("search.trials", str(spec.search.trials)),
        ("search.max_concurrent", str(spec.search.max_concurrent)),
        ("early_stopping", spec.early_stopping.policy),
        ("max_epochs", str(spec.early_stopping.max_epochs)),
        ("objective.metric", f"{spec.objective.metric} ({spec.objective.mode})"),
        ("objective.system", spec.objective.system),
        ("pipetune.enabled", str(spec.pipetune.enabled)),
        ("system.default", spec.system.default.label()),
    ]


def study_files(spec: JobSpec) -> list[tuple[dict[str, Any], str]]:
    """The study run's JSON artifacts ``(content, file name)``: the whole job, and its
    two search spaces."""
    spec_dict = spec.to_dict()
    return [(spec_dict, "job.json"),
            ({"hyperparameters": spec_dict["hyperparameters"], "system": spec_dict["system"]},
             "spaces.json")]


def epoch_writes(objective: str, trial: Trial, result: EpochResult) -> tuple[Metrics, Pairs]:
    """One finished epoch's metrics (at ``step = epoch``, the time it finished on its
    worker) and tags on its trial's run: its measurement, its ``cost_per_sample`` under
    ``objective``, every system knob, its phase, config and why it ran under it."""
    ts = int(result.finished * 1000)
    m = result.measurement
    values: dict[str, float] = {
        "phase_code": PHASE_CODES[result.phase],
        "train_loss": result.train_loss,
        "epoch_seconds": m.wall_s,
        "samples_per_s": m.samples_per_s,
        "energy_j": m.energy_j,
        "cpu_util": m.cpu_util,
        "cost_per_sample": result.cost(objective),
        "profiler_overhead_s": m.overhead_s,
        "one_time_s": m.one_time_s,
        "steady_step_s": m.steady_step_s,
        "cpu_wait_s": m.cpu_wait_s,
        **{k: v for k, v in result.metrics.items()},
        **result.system.as_metrics(),
    }
    if result.epoch == 1 and startup_s(trial) is not None:
        values["startup_s"] = startup_s(trial)
    metrics = [(k, float(v), result.epoch, ts) for k, v in values.items()]
    tags = [
        (f"epoch.{result.epoch:03d}.phase", result.phase.value),
        (f"epoch.{result.epoch:03d}.system", result.system.label()),
        ("energy_source", m.energy_source),
        ("counters_source", m.counters_source),
    ]
    if len(trial.decisions) >= result.epoch:  # why this epoch ran under its config
        decision = trial.decisions[result.epoch - 1]
        tags.append((f"epoch.{result.epoch:03d}.decision", short_reason(decision.reason)))
        if decision.inputs:  # the figures it weighed (a compile's price, the epochs ...)
            tags.append((f"epoch.{result.epoch:03d}.weighed", json.dumps(
                dict(decision.inputs), sort_keys=True, default=str)[:5000]))
        tags.append((NOTE_TAG, decisions_note(trial)))
    return metrics, tags


#: An epoch's ``epoch.NNN.decision`` tag at most, in characters: the gist of the
#: decision (MLflow's tag chips cut a longer value); the whole reason is in the trial
#: run's description (:func:`decisions_note`).
SHORT_REASON = 48
#: MLflow's run description (shown on the run's page).
NOTE_TAG = "mlflow.note.content"
#: The description at most (MLflow keeps tag values of up to 8,000 characters).
NOTE_LIMIT = 7900


def short_reason(reason: str) -> str:
    """The gist of a decision's reason: up to its first ``;`` or `` (``, cut to
    :data:`SHORT_REASON` characters."""
    head = reason
    for stop in ("; ", " ("):
        head = head.split(stop, 1)[0]
    head = head.strip()
    return head if len(head) <= SHORT_REASON else head[:SHORT_REASON - 1].rstrip() + "\u2026"


def decisions_note(trial: Trial) -> str:
    """The trial run's description: why each of its epochs ran under its system config,
    one line an epoch, whole (the newest epochs where all do not fit)."""
    lines = []
    for result, decision in zip(trial.results, trial.decisions, strict=False):
        lines.append(f"- epoch {result.epoch} ({result.phase.value}, "
                     f"{result.system.label()}): {decision.reason}")
    head = "Why each epoch ran under its system config (pipetune):\n\n"
    body, cut = "\n".join(lines), 0
    while len(head) + len(body) > NOTE_LIMIT and len(lines) > 1:
        lines.pop(0)
        cut += 1
        body = "\n".join(lines)
    if cut:
        head += f"(the first {cut} epoch(s): their epoch.NNN.decision tags)\n\n"
    return (head + body)[:NOTE_LIMIT]


def trial_end_writes(trial: Trial, metric: str, ended: float) -> tuple[Metrics, Pairs, Pairs]:
    """An ended trial's metrics, params and tags on its run (``ended``: when, s): its
    outcome and error, the ground truth's answer, the config it settled on, its final
    ``metric`` and its phases."""
    tags = [("outcome", str(trial.state))]
    if trial.error:
        tags.append(("error", trial.error[:5000]))
    now = _ms_floor(ended)
    metrics = [("probe_epochs", float(trial.probe_epochs), 0, now)]
    if trial.match is not None:
        tags.append(("groundtruth", "hit" if trial.match.hit else "miss"))
        tags.append(("groundtruth.reason", trial.match.reason[:5000]))
        # the figures the reason shows rounded, at full precision
        for name in ("distance", "bound", "cost"):
            figure = getattr(trial.match, name)
            if figure is not None and math.isfinite(figure):
                metrics.append((f"groundtruth_{name}", float(figure), 0, now))
    if trial.final_system is not None:
        tags.append(("system.final", trial.final_system.label()))
    value = trial.last_value(metric)
    if value is not None:
        metrics.append((f"final_{metric}", float(value), trial.epochs_run, now))
    # A trial the checkpoint store refused goes on when the study is resumed: its
    # phases (a param, written once) are logged when it really ends.
    refused = trial.failure is not None and refused_by_store(trial.failure.line())
    params = [("phases", phase_runs(trial)[:6000])] if trial.results and not refused \
        else []
    return metrics, params, tags
