"""Known jobs: which trials the ground truth may answer for as "this very job", and
when a first epoch run under a known job's config does not confirm it."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from pipetune.spec import split_system_params

if TYPE_CHECKING:
    from pipetune.engine.trial import Trial
    from pipetune.runner import EpochResult
    from pipetune.spec import JobSpec

#: A known job's first epoch confirms its config unless its steady cost is more than
#: this much above the known one (studies run on machines of varying load).
KNOWN_MARGIN = 0.25
#: ... and more than this much per epoch (seconds, or joules): an epoch of milliseconds
#: varies by more than any margin from one process to the next.
KNOWN_FLOOR = 0.05


def job_key(spec: JobSpec, trial: Trial) -> str:
    """What makes two trials the same job for the ground truth's known-job answer: the
    workload, its params and the hyperparameters that are not floats (sizes, choices,
    the batch size: what shapes the model; rates and coefficients do not). The worker's
    graph signature checks the guess after the first epoch."""
    hparams = split_system_params(trial.params, spec.system.default)[0]
    shaping = {k: v for k, v in sorted(hparams.items()) if not isinstance(v, float)}
    raw = json.dumps([spec.workload.name, spec.workload.params, shaping],
                     sort_keys=True, default=str)
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def unconfirmed_because(trial: Trial, result: EpochResult, cost_unit: str) -> str | None:
    """Why the trial's first epoch, run under a known job's config, does not confirm
    it: another model graph, or a steady cost more than :data:`KNOWN_MARGIN` above the
    known one. None where it confirms it, or where there was nothing to confirm (the
    trial then starts over from a default profiled epoch)."""
    match = trial.match
    if (match is None or match.known_graph is None or result.epoch != 1
            or trial.baseline != 0):
        return None
    if result.graph and match.known_graph and result.graph != match.known_graph:
        return f"model graph {result.graph} is not the known job's {match.known_graph}"
    if (match.config is not None and not match.config.one_time_knobs()
            and result.system == match.config and match.cost is not None
            and match.cost_unit == cost_unit):
        first = trial.history[0]
        floor = KNOWN_FLOOR / first.samples if first.samples else 0.0
        steady = first.steady_cost
        if steady > match.cost * (1.0 + KNOWN_MARGIN) + floor:
            return (f"ran {steady / match.cost:.2f}x the known cost under "
                    f"{result.system.label()}")
    return None
