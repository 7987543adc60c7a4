"""The system tuner: which system config each epoch of a trial runs under.

- :mod:`~pipetune.tuner.system_tuner`: the policy, :class:`SystemTuner`;
- :mod:`~pipetune.tuner.plan`: the probe plan, from the job's ``system.space``;
- :mod:`~pipetune.tuner.one_time`: one-time knobs (compile), their price weighed in
  seconds against what the epochs a trial is expected to run would save;
- :mod:`~pipetune.tuner.decisions`: what it reads (:class:`EpochObservation`) and
  answers (:class:`TuningDecision`).

The tuner is a *policy*, as the study flow's searcher and scheduler are: it takes what
a trial's finished epochs observed and returns a decision for the next epoch. It keeps
no state between calls, so the same history always gives the same decision; a retried
or resumed trial picks up where it was.

One trial, PipeTune-style::

    epoch 1   PROFILE  under the default config; the caller profiles it and looks the
                       profile up in the ground truth
    hit       TRAIN    under the ground truth's config for every later epoch
    miss      PROBE    one untried candidate per epoch (real training), then
              TRAIN    under the cheapest config observed, which the decision asks the
                       caller to record in the ground truth

>>> from pipetune.system.config import MachineInfo, SystemConfig
>>> tuner = SystemTuner(SystemConfig(cores=1), {"cores": [1, 2]}, machine=MachineInfo(cores=2))
>>> tuner.next_epoch([], epochs_left=3, match=None).phase
<Phase.PROFILE: 'profile'>
"""

from __future__ import annotations

from pipetune.states import GroundTruthMatch, Phase
from pipetune.tuner.decisions import EpochObservation, TuningDecision
from pipetune.tuner.one_time import (
    CHEAP_ONE_TIME_SHARE,
    MIN_ONE_TIME_HORIZON,
    ONE_TIME_PRICE_PRIOR_S,
    ONE_TIME_SAVING_PRIOR,
    OneTimePrice,
)
from pipetune.tuner.plan import PLANS, SPACE_FIELD, describe_change
from pipetune.tuner.system_tuner import REUSE_MARGIN, WARMUP_MARGIN, SystemTuner

__all__ = ["CHEAP_ONE_TIME_SHARE", "MIN_ONE_TIME_HORIZON", "ONE_TIME_PRICE_PRIOR_S",
           "ONE_TIME_SAVING_PRIOR", "PLANS", "REUSE_MARGIN", "SPACE_FIELD", "WARMUP_MARGIN",
           "EpochObservation", "GroundTruthMatch", "OneTimePrice", "Phase", "SystemTuner",
           "TuningDecision", "describe_change"]
