"""Search-space distributions: sampling, grids, JSON and Optuna conversion, validation."""

from __future__ import annotations

import math
import random

import pytest

from pipetune.errors import SpecError
from pipetune.space import (
    Choice,
    IntUniform,
    LogUniform,
    Uniform,
    space_from_json,
    space_to_json,
)

SPACE_JSON = {
    "lr": {"type": "loguniform", "low": 1e-3, "high": 0.1},
    "momentum": {"type": "uniform", "low": 0.0, "high": 0.99},
    "embed_dim": {"type": "int", "low": 16, "high": 128, "log": True},
    "layers": {"type": "int", "low": 1, "high": 4, "log": False},
    "batch_size": {"type": "choice", "values": [32, 64, 128]},
    "act": {"type": "choice", "values": ["relu", "tanh", None, True]},
}


def test_json_round_trip_gives_equal_space_and_same_json():
    space = space_from_json(SPACE_JSON)
    assert space == {
        "lr": LogUniform(1e-3, 0.1),
        "momentum": Uniform(0.0, 0.99),
        "embed_dim": IntUniform(16, 128, log=True),
        "layers": IntUniform(1, 4),
        "batch_size": Choice((32, 64, 128)),
        "act": Choice(("relu", "tanh", None, True)),
    }
    assert space_to_json(space) == SPACE_JSON
    assert space_from_json(space_to_json(space)) == space


@pytest.mark.parametrize("name", list(SPACE_JSON))
def test_samples_stay_in_domain_and_repeat_with_the_seed(name):
    dist = space_from_json(SPACE_JSON)[name]
    draws = [dist.sample(random.Random(7)) for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]
    rng = random.Random(0)
    for v in (dist.sample(rng) for _ in range(300)):
        if isinstance(dist, Choice):
            assert v in dist.values
        else:
            assert dist.low <= v <= dist.high
            if isinstance(dist, IntUniform):
                assert isinstance(v, int)


def test_int_samples_reach_both_ends():
    rng = random.Random(1)
    for dist in (IntUniform(1, 4), IntUniform(1, 4, log=True)):
        assert {dist.sample(rng) for _ in range(400)} == {1, 2, 3, 4}


def test_loguniform_spreads_evenly_over_orders_of_magnitude():
    rng = random.Random(3)
    draws = [LogUniform(1e-4, 1.0).sample(rng) for _ in range(2000)]
    below_1e2 = sum(d < 1e-2 for d in draws) / len(draws)
    assert 0.45 < below_1e2 < 0.55  # a plain uniform would put ~1% there


def test_grids():
    assert Uniform(0.0, 1.0).grid(3) == [0.0, 0.5, 1.0]
    assert LogUniform(1e-3, 1e-1).grid(3) == pytest.approx([1e-3, 1e-2, 1e-1])
    assert LogUniform(1e-3, 1e-1).grid(3)[-1] == 1e-1
    assert IntUniform(1, 10).grid(4) == [1, 4, 7, 10]
    assert IntUniform(1, 3).grid(5) == [1, 2, 3]
    assert IntUniform(1, 100, log=True).grid(3) == [1, 10, 100]
    assert Choice(("a", "b", "c")).grid(2) == ["a", "b", "c"]
    assert Uniform(0.0, 2.0).grid(1) == [1.0]


def test_to_optuna_matches_the_distribution():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    space = space_from_json(SPACE_JSON)
    assert space["lr"].to_optuna() == FloatDistribution(1e-3, 0.1, log=True)
    assert space["momentum"].to_optuna() == FloatDistribution(0.0, 0.99)
    assert space["embed_dim"].to_optuna() == IntDistribution(16, 128, log=True)
    assert space["batch_size"].to_optuna() == CategoricalDistribution([32, 64, 128])


def test_choice_keeps_equal_looking_values_of_different_types():
    assert Choice((1, True, 1.5)).values == (1, True, 1.5)
    assert Choice([1, 2]).values == (1, 2)
    assert hash(Choice([1, 2])) == hash(Choice((1, 2)))


@pytest.mark.parametrize(
    ("dist", "field", "words"),
    [
        ({"type": "uniform", "low": 1.0, "high": 1.0}, "hyperparameters.x.low", "< high"),
        ({"type": "uniform", "low": 2, "high": 1}, "hyperparameters.x.low", "< high"),
        ({"type": "loguniform", "low": 0.0, "high": 1.0}, "hyperparameters.x.low", "> 0"),
        ({"type": "int", "low": 0, "high": 8, "log": True}, "hyperparameters.x.low", "> 0"),
        ({"type": "int", "low": 1.5, "high": 8}, "hyperparameters.x.low", "integer"),
        ({"type": "int", "low": 1, "high": 8, "log": "yes"}, "hyperparameters.x.log", "true"),
        ({"type": "uniform", "low": "a", "high": 1}, "hyperparameters.x.low", "number"),
        ({"type": "uniform", "low": 0, "high": math.inf}, "hyperparameters.x.high", "number"),
        ({"type": "choice", "values": []}, "hyperparameters.x.values", "at least one"),
        ({"type": "choice", "values": "abc"}, "hyperparameters.x.values", "list"),
        ({"type": "choice", "values": [1, 1]}, "hyperparameters.x.values", "twice"),
        ({"type": "choice", "values": [[1, 2]]}, "hyperparameters.x.values", "strings"),
        ({"type": "normal", "low": 0, "high": 1}, "hyperparameters.x.type", "loguniform"),
        ({"low": 0, "high": 1}, "hyperparameters.x.type", "required"),
        ({"type": "uniform", "low": 0}, "hyperparameters.x.high", "required"),
        ({"type": "uniform", "low": 0, "hihg": 1}, "hyperparameters.x.hihg", "allowed"),
        ([0, 1], "hyperparameters.x", "mapping"),
    ],
)
def test_invalid_distributions_name_the_field(dist, field, words):
    with pytest.raises(SpecError) as info:
        space_from_json({"x": dist})
    assert info.value.field == field
    assert words in info.value.message
    assert "\n" not in str(info.value)


def test_direct_construction_checks_itself():
    with pytest.raises(SpecError) as info:
        LogUniform(-1.0, 1.0)
    assert info.value.field == "low"


def test_space_must_be_a_mapping():
    with pytest.raises(SpecError) as info:
        space_from_json([1, 2])
    assert info.value.field == "hyperparameters"
