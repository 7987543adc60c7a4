"""Searchers: one ask/tell contract for every algorithm, then what each one adds."""

from __future__ import annotations

import math
import warnings

import pytest

from pipetune.errors import SpecError
from pipetune.searchers import (
    SEARCHERS,
    GridSearcher,
    Searcher,
    TPESearcher,
    TrialState,
    make_searcher,
)
from pipetune.space import Choice, Distribution, IntUniform, LogUniform, Uniform

SPACE: dict[str, Distribution] = {
    "lr": LogUniform(1e-3, 1e-1),
    "momentum": Uniform(0.0, 0.9),
    "width": IntUniform(4, 32, log=True),
    "batch_size": Choice((32, 64)),
}


def objective(params: dict) -> float:
    """A known answer: best at lr=1e-2, momentum=0.5, width=16, batch_size=64."""
    return (
        -((math.log10(params["lr"]) + 2) ** 2)
        - (params["momentum"] - 0.5) ** 2
        - abs(params["width"] - 16) / 16
        + (0.1 if params["batch_size"] == 64 else 0.0)
    )


def in_domain(dist: Distribution, value) -> bool:
    if isinstance(dist, Choice):
        return value in dist.values
    if isinstance(dist, IntUniform) and not isinstance(value, int):
        return False
    return dist.low <= value <= dist.high


def drive(searcher: Searcher, n: int, score=objective) -> list[dict]:
    """Ask up to ``n`` trials, telling each one as COMPLETE/STOPPED/FAILED in turn."""
    seen = []
    for i in range(n):
        s = searcher.ask()
        if s is None:
            break
        seen.append(s.params)
        state = (TrialState.COMPLETE, TrialState.STOPPED, TrialState.FAILED)[i % 3]
        value = None if state is TrialState.FAILED else score(s.params)
        searcher.tell(s.trial_id, value, state)
    return seen


# -- the contract -----------------------------------------------------------------------


@pytest.fixture(params=sorted(SEARCHERS))
def algorithm(request) -> str:
    return request.param


def test_same_seed_same_configs(algorithm):
    a = drive(make_searcher(algorithm, SPACE, mode="max", seed=5, grid_points=2), 15)
    b = drive(make_searcher(algorithm, SPACE, mode="max", seed=5, grid_points=2), 15)
    assert len(a) >= 12
    assert a == b


def test_configs_are_in_the_space_with_fresh_ids(algorithm):
    searcher = make_searcher(algorithm, SPACE, mode="max", seed=1)
    ids = []
    for _ in range(12):
        s = searcher.ask()
        assert set(s.params) == set(SPACE)
        assert all(in_domain(SPACE[k], v) for k, v in s.params.items()), s.params
        ids.append(s.trial_id)
        searcher.tell(s.trial_id, objective(s.params), TrialState.COMPLETE)
    assert ids == list(range(12))


def test_several_trials_in_flight_told_out_of_order(algorithm):
    searcher = make_searcher(algorithm, SPACE, mode="min", seed=2)
    pending = [searcher.ask() for _ in range(3)]
    assert len({s.trial_id for s in pending}) == 3
    for s in reversed(pending):
        searcher.tell(s.trial_id, objective(s.params), TrialState.COMPLETE)
    assert searcher.ask().trial_id == 3
    assert sorted(searcher.told) == [0, 1, 2]


def test_tell_rejects_unknown_and_repeated_trials(algorithm):
    searcher = make_searcher(algorithm, SPACE, mode="max", seed=0)
    s = searcher.ask()
    with pytest.raises(ValueError, match="never asked"):
        searcher.tell(s.trial_id + 1, 0.5, TrialState.COMPLETE)
    searcher.tell(s.trial_id, 0.5, TrialState.COMPLETE)
    with pytest.raises(ValueError, match="already told"):
        searcher.tell(s.trial_id, 0.5, TrialState.COMPLETE)


def test_complete_without_a_finite_value_counts_as_failed(algorithm):
    searcher = make_searcher(algorithm, SPACE, mode="max", seed=0)
    a, b = searcher.ask(), searcher.ask()
    searcher.tell(a.trial_id, float("nan"), TrialState.COMPLETE)
    searcher.tell(b.trial_id, None, "completed")
    assert searcher.told == {
        0: (pytest.approx(math.nan, nan_ok=True), TrialState.FAILED),
        1: (None, TrialState.FAILED),
    }


def test_bad_names_are_spec_errors():
    with pytest.raises(SpecError) as info:
        make_searcher("bayes", SPACE, mode="max", seed=0)
    assert info.value.field == "search.algorithm"
    with pytest.raises(SpecError) as info:
        make_searcher("random", SPACE, mode="maximize", seed=0)
    assert info.value.field == "objective.mode"


# -- random -------------------------------------------------------------------------------


def test_random_seeds_differ():
    a = drive(make_searcher("random", SPACE, seed=0), 5)
    b = drive(make_searcher("random", SPACE, seed=1), 5)
    assert a != b


# -- grid ---------------------------------------------------------------------------------


def test_grid_walks_the_product_in_order_then_is_exhausted():
    space = {"bs": Choice((32, 64)), "m": Uniform(0.0, 1.0)}
    searcher = GridSearcher(space, grid_points=3)
    assert searcher.size == 6
    configs = drive(searcher, 100, score=lambda p: p["m"])
    assert configs == [
        {"bs": 32, "m": 0.0},
        {"bs": 32, "m": 0.5},
        {"bs": 32, "m": 1.0},
        {"bs": 64, "m": 0.0},
        {"bs": 64, "m": 0.5},
        {"bs": 64, "m": 1.0},
    ]
    assert searcher.ask() is None
    assert searcher.ask() is None


def test_grid_points_option_reaches_the_grid():
    searcher = make_searcher("grid", {"w": IntUniform(1, 9)}, grid_points=5)
    assert [p["w"] for p in drive(searcher, 10, score=lambda p: p["w"])] == [1, 3, 5, 7, 9]


# -- tpe ----------------------------------------------------------------------------------


def test_tpe_states_reach_optuna():
    from optuna.trial import TrialState as OptunaState

    searcher = TPESearcher(SPACE, mode="max", seed=0)
    for value, state in [
        (0.7, TrialState.COMPLETE),
        (0.4, TrialState.STOPPED),
        (None, TrialState.FAILED),
        (None, TrialState.STOPPED),
    ]:
        searcher.tell(searcher.ask().trial_id, value, state)
    trials = searcher.study.trials
    assert [t.state for t in trials] == [
        OptunaState.COMPLETE,
        OptunaState.PRUNED,
        OptunaState.FAIL,
        OptunaState.PRUNED,
    ]
    assert [t.value for t in trials] == [0.7, 0.4, None, None]


@pytest.mark.parametrize("mode", ["max", "min"])
def test_tpe_finds_the_known_optimum(mode):
    sign = 1.0 if mode == "max" else -1.0
    space = {"x": Uniform(0.0, 1.0)}
    searcher = TPESearcher(space, mode=mode, seed=0, n_startup_trials=5)
    xs = []
    for _ in range(30):
        s = searcher.ask()
        xs.append(s.params["x"])
        searcher.tell(s.trial_id, sign * -((s.params["x"] - 0.3) ** 2), TrialState.COMPLETE)
    modelled = sorted(abs(x - 0.3) for x in xs[5:])
    # Uniform random draws have a median |x - 0.3| of 0.25; the model should close in.
    assert modelled[len(modelled) // 2] < 0.15
    assert modelled[0] < 0.01


def test_tpe_is_quiet_and_warning_free(capfd):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drive(TPESearcher(SPACE, mode="max", seed=3, n_startup_trials=3), 8)
    out, err = capfd.readouterr()
    assert out == "" and err == ""
