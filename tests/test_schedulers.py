"""Schedulers: the epoch-budget contract for all, and ASHA on hand-computed curves."""

from __future__ import annotations

import pytest

from pipetune.errors import SpecError
from pipetune.schedulers import (
    ASHAScheduler,
    Decision,
    NoopScheduler,
    Scheduler,
    make_scheduler,
)


def run_sequentially(scheduler: Scheduler, curves: dict[int, list[float]]) -> dict[int, int]:
    """Feed each trial's curve epoch by epoch, one trial after another; the epoch each
    trial was stopped at."""
    stopped_at = {}
    for trial_id, curve in curves.items():
        for epoch, value in enumerate(curve, start=1):
            if scheduler.on_epoch_result(trial_id, epoch, value) is Decision.STOP:
                stopped_at[trial_id] = epoch
                break
        scheduler.on_trial_remove(trial_id)
    return stopped_at


# -- the contract -----------------------------------------------------------------------

SCHEDULERS = {
    "asha": lambda: ASHAScheduler(min_epochs=1, max_epochs=3, reduction_factor=2),
    "noop": lambda: NoopScheduler(max_epochs=3),
}


@pytest.fixture(params=sorted(SCHEDULERS))
def scheduler(request) -> Scheduler:
    return SCHEDULERS[request.param]()


def test_always_stops_at_the_epoch_budget(scheduler):
    # Rising curves: ASHA keeps each one, so only the budget stops them.
    stopped = run_sequentially(
        scheduler, {t: [0.1 * t + 0.01 * e for e in range(9)] for t in range(4)}
    )
    assert stopped == {0: 3, 1: 3, 2: 3, 3: 3}
    assert scheduler.on_epoch_result(99, 7, 1.0) is Decision.STOP


def test_epochs_count_from_one(scheduler):
    with pytest.raises(ValueError, match="epoch"):
        scheduler.on_epoch_result(0, 0, 0.5)


def test_a_one_epoch_budget_stops_after_the_first_epoch(scheduler):
    one = type(scheduler)(max_epochs=1)
    assert one.on_epoch_result(0, 1, 0.5) is Decision.STOP


# -- ASHA -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("min_epochs", "max_epochs", "rf", "rungs"),
    [(1, 4, 2, (1, 2)), (1, 9, 3, (1, 3)), (2, 16, 2, (2, 4, 8)), (1, 1, 2, ()), (3, 3, 2, ())],
)
def test_rungs_sit_below_the_budget(min_epochs, max_epochs, rf, rungs):
    asha = ASHAScheduler(min_epochs=min_epochs, max_epochs=max_epochs, reduction_factor=rf)
    assert asha.rungs == rungs


# Rungs at epochs 1 and 2, cutoff = median (1 - 1/2 quantile) of earlier records there.
#   epoch 1: t0 0.50 first -> go; t1 0.40 < 0.50 -> stop; t2 0.55 >= median(.5,.4)=.45 -> go;
#            t3 0.45 < median(.5,.4,.55)=.50 -> stop; t4 0.52 >= median(.5,.4,.55,.45)=.475 -> go
#   epoch 2: t0 0.60 first -> go; t2 0.58 < 0.60 -> stop; t4 0.62 >= median(.60,.58)=.59 -> go
CURVES = {
    0: [0.50, 0.60, 0.70, 0.75],
    1: [0.40, 0.90, 0.90, 0.90],
    2: [0.55, 0.58, 0.90, 0.90],
    3: [0.45, 0.65, 0.70, 0.80],
    4: [0.52, 0.62, 0.66, 0.70],
}
EXPECTED_STOPS = {0: 4, 1: 1, 2: 2, 3: 1, 4: 4}


@pytest.mark.parametrize("mode", ["max", "min"])
def test_asha_stops_the_trials_computed_by_hand(mode):
    sign = 1.0 if mode == "max" else -1.0
    asha = ASHAScheduler(min_epochs=1, max_epochs=4, reduction_factor=2, mode=mode)
    curves = {t: [sign * v for v in c] for t, c in CURVES.items()}
    assert run_sequentially(asha, curves) == EXPECTED_STOPS
    assert asha.values_at(1) == {t: curves[t][0] for t in curves}
    assert asha.values_at(2) == {0: curves[0][1], 2: curves[2][1], 4: curves[4][1]}


def test_asha_is_asynchronous_epochs_round_robin():
    asha = ASHAScheduler(min_epochs=1, max_epochs=4, reduction_factor=2)
    alive = set(CURVES)
    stopped_at = {}
    for epoch in range(1, 5):
        for t in sorted(alive):
            if asha.on_epoch_result(t, epoch, CURVES[t][epoch - 1]) is Decision.STOP:
                stopped_at[t] = epoch
        alive -= set(stopped_at)
    assert stopped_at == EXPECTED_STOPS


def test_asha_with_reduction_factor_three_keeps_the_top_third():
    # Rungs 1 and 3; cutoff = 2/3 quantile of earlier records.
    #   t0 .50 first -> go; t1 .60 >= q(.5)=.5 -> go;
    #   t2 .55 < q(.5,.6)=.5667 -> stop; t3 .58 >= q(.5,.55,.6)=.5667 -> go
    asha = ASHAScheduler(min_epochs=1, max_epochs=9, reduction_factor=3)
    decisions = [asha.on_epoch_result(t, 1, v) for t, v in enumerate([0.50, 0.60, 0.55, 0.58])]
    assert decisions == [Decision.CONTINUE, Decision.CONTINUE, Decision.STOP, Decision.CONTINUE]
    assert asha.on_epoch_result(0, 2, 0.0) is Decision.CONTINUE  # no rung at epoch 2


def test_asha_stops_nan_without_recording_it():
    asha = ASHAScheduler(min_epochs=1, max_epochs=4)
    assert asha.on_epoch_result(0, 1, float("nan")) is Decision.STOP
    assert asha.values_at(1) == {}
    assert asha.on_epoch_result(1, 1, 0.1) is Decision.CONTINUE


def test_asha_retried_rung_replaces_the_record():
    asha = ASHAScheduler(min_epochs=1, max_epochs=4)
    asha.on_epoch_result(0, 1, 0.9)
    asha.on_epoch_result(1, 1, 0.5)
    assert asha.on_epoch_result(1, 1, 0.95) is Decision.CONTINUE
    assert asha.values_at(1) == {0: 0.9, 1: 0.95}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_epochs": 5, "max_epochs": 4},
        {"min_epochs": 0, "max_epochs": 4},
        {"max_epochs": 4, "reduction_factor": 1},
        {"max_epochs": 0},
        {"max_epochs": 4, "mode": "maximize"},
    ],
)
def test_asha_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        ASHAScheduler(**kwargs)


# -- make_scheduler ---------------------------------------------------------------------


def test_make_scheduler_from_a_mapping_or_a_spec_section():
    from pipetune.spec import EarlyStoppingSpec

    asha = make_scheduler(
        EarlyStoppingSpec(policy="asha", min_epochs=2, max_epochs=9, reduction_factor=2), "min"
    )
    assert isinstance(asha, ASHAScheduler)
    assert (asha.rungs, asha.mode) == ((2, 4, 8), "min")
    noop = make_scheduler({"policy": "none", "max_epochs": 5}, "max")
    assert isinstance(noop, NoopScheduler) and noop.max_epochs == 5
    with pytest.raises(SpecError) as info:
        make_scheduler({"policy": "median", "max_epochs": 5}, "max")
    assert info.value.field == "early_stopping.policy"


def test_recorded_is_the_deprecated_name_of_values_at():
    asha = ASHAScheduler(min_epochs=1, max_epochs=4, reduction_factor=2, mode="max")
    asha.on_epoch_result(0, 1, 0.5)
    with pytest.warns(DeprecationWarning, match="values_at"):
        assert asha.recorded(1) == asha.values_at(1) == {0: 0.5}
