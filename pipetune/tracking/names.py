"""How a study's MLflow record names and shapes what it writes: the study's metric names
(``study_<key>``), the epochs' ``phase_code``, a trial's start time and its phases as
runs (``profile, probe x2, train x3``), the per-epoch profile table, and times in
milliseconds as MLflow keeps them. Re-exported by :mod:`pipetune.tracking.tracker`."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from pipetune.states import Phase

if TYPE_CHECKING:
    from pipetune.engine.trial import Trial

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
    """When ``trial`` started: the engine's ``started`` (or now when unknown), or its
    first epoch's start on the worker if that is earlier (another host's clock)."""
    started = trial.started if trial.started is not None else time.time()
    if trial.results:
        started = min(started, trial.results[0].started)
    return started


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
