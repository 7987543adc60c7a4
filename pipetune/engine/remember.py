"""What the engine writes to the ground truth: the system config each trial kept, under
its first profiled epoch's profile, so that a similar job later starts from it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipetune.engine.known import job_key
from pipetune.tuner import Phase

if TYPE_CHECKING:
    from pipetune.engine.trial import Trial
    from pipetune.groundtruth import GroundTruth
    from pipetune.spec import JobSpec
    from pipetune.system.config import SystemConfig
    from pipetune.tuner import SystemTuner


class Remembering:
    """The ground-truth writes of one study (none where ``ground_truth`` is None).
    ``cost_unit`` goes with each cost: a later study only reuses costs in its unit."""

    def __init__(self, ground_truth: GroundTruth | None, spec: JobSpec, study_id: str,
                 cost_unit: str):
        self.ground_truth, self.spec, self.study_id = ground_truth, spec, study_id
        self.cost_unit = cost_unit

    def remember(self, trial: Trial, config: SystemConfig, cost: float, *,
                 one_time: float | None = None, speedup: float | None = None,
                 replaying: bool = False) -> None:
        """``trial`` kept ``config`` at ``cost``. One entry per trial and kept config: a
        one-time knob probed later (once the horizon allowed it) writes again only when
        it changed the choice. ``replaying``: written before the study stopped."""
        if self.ground_truth is None or trial.remembered == config or not trial.results:
            return
        if replaying:
            trial.remembered = config
            return
        first = trial.results[trial.baseline]
        self.ground_truth.remember(
            first.measurement.profile,
            first.batch_size,
            self.spec.objective.system,
            config,
            cost,
            job=self.spec.name,
            trial=f"{self.study_id}/{trial.trial_id}",
            one_time=one_time,
            speedup=speedup,
            job_key=job_key(self.spec, trial),
            graph=first.graph,
            cost_unit=self.cost_unit,
        )
        trial.remembered = config

    def at_end(self, tuner: SystemTuner, trial: Trial, *, replaying: bool = False) -> None:
        """A trial that ended (not failed) before its next decision: still remember
        what that decision would have kept. Right after probing, the best probed config;
        right after its first epoch under a known job's one-time knob, what it cost."""
        seen = trial.tuner_history()
        if not seen:
            return
        if seen[-1].phase is Phase.PROBE:
            best = tuner.best_observed(seen)
            if best is not None:
                one_time, speedup = tuner.figures(seen, best[0])
                self.remember(trial, *best, one_time=one_time, speedup=speedup,
                              replaying=replaying)
        elif trial.match is not None:
            last = seen[-1]
            under = [o for o in seen if o.system == last.system]
            if (trial.match.hit and last.system == trial.match.config
                    and last.system.one_time_knobs() and len(under) == 1):
                one_time, speedup = tuner.figures(seen, last.system)
                self.remember(trial, last.system, last.steady_cost, one_time=one_time,
                              speedup=speedup, replaying=replaying)
