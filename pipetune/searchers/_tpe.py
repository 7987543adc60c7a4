"""Tree-structured Parzen Estimator search, through Optuna's ask-and-tell interface."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pipetune.searchers._base import Searcher, TrialState
from pipetune.space import Distribution


class TPESearcher(Searcher):
    """Optuna's ``TPESampler`` driving an in-memory study.

    How trial states reach Optuna:

    - ``COMPLETE`` -> ``study.tell(trial, value)``.
    - ``STOPPED`` -> the last value is reported as the trial's intermediate value at
      step 0, then ``study.tell(trial, state=PRUNED)``. Optuna refuses values with
      ``PRUNED`` but takes the last intermediate value as the pruned trial's value, and
      TPE ranks pruned trials below completed ones and among themselves by that value.
      A stopped trial without a finite value is pruned with no value.
    - ``FAILED`` -> ``study.tell(trial, state=FAIL)``; TPE ignores it.

    ``n_startup_trials`` (Optuna's default 10) are sampled at random before TPE models
    the results. Optuna's logging is set to WARNING so studies stay quiet.
    """

    def __init__(
        self,
        space: Mapping[str, Distribution],
        *,
        mode: str = "max",
        seed: int = 0,
        n_startup_trials: int = 10,
    ) -> None:
        super().__init__(space, mode=mode, seed=seed)
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._distributions = {name: dist.to_optuna() for name, dist in self.space.items()}
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup_trials)
        self.study = optuna.create_study(
            direction="maximize" if mode == "max" else "minimize", sampler=sampler
        )
        self._trials: dict[int, Any] = {}

    def _suggest(self, trial_id: int) -> dict[str, Any] | None:
        trial = self.study.ask(self._distributions)
        self._trials[trial_id] = trial
        return {name: trial.params[name] for name in self.space}

    def _observe(self, trial_id: int, value: float | None, state: TrialState) -> None:
        from optuna.trial import TrialState as OptunaState

        trial = self._trials.pop(trial_id)
        if state is TrialState.COMPLETE:
            self.study.tell(trial, value)
        elif state is TrialState.STOPPED:
            if value is not None and math.isfinite(value):
                trial.report(value, step=0)
            self.study.tell(trial, state=OptunaState.PRUNED)
        else:
            self.study.tell(trial, state=OptunaState.FAIL)
