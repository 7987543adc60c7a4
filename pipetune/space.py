"""Search spaces: a plain dict of distribution objects, with JSON in and out.

A space maps a hyperparameter name to one of :class:`Choice`, :class:`Uniform`,
:class:`LogUniform` or :class:`IntUniform`. Each distribution is a frozen value that
checks itself, samples from a :class:`random.Random`, lays out a grid, and converts to
JSON (for logs and deployment parameters) and to an Optuna distribution.

>>> space = space_from_json({"lr": {"type": "loguniform", "low": 1e-3, "high": 0.1},
...                          "batch_size": {"type": "choice", "values": [32, 64]}})
>>> space["batch_size"].grid(3)
[32, 64]
>>> space_to_json(space)["lr"]
{'type': 'loguniform', 'low': 0.001, 'high': 0.1}
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pipetune.errors import SpecError

#: JSON-able scalar types a :class:`Choice` may hold (what Optuna's categoricals accept).
_CHOICE_TYPES = (str, int, float, bool, type(None))


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _check_bounds(low: Any, high: Any, *, integer: bool, log: bool) -> None:
    kind = "an integer" if integer else "a number"
    for name, v in (("low", low), ("high", high)):
        ok = isinstance(v, int) and not isinstance(v, bool) if integer else _is_number(v)
        if not ok or (not integer and not math.isfinite(v)):
            raise SpecError(name, f"must be {kind}, got {v!r}")
    if low >= high:
        raise SpecError("low", f"must be < high ({high!r}), got {low!r}")
    if log and low <= 0:
        raise SpecError("low", f"must be > 0 on a log scale, got {low!r}")


def _linspace(low: float, high: float, n: int) -> list[float]:
    if n < 1:
        raise ValueError(f"grid needs n >= 1, got {n}")
    if n == 1:
        return [(low + high) / 2]
    step = (high - low) / (n - 1)
    # The last point is `high` exactly, not low + (n-1)*step with its rounding error.
    return [low + i * step for i in range(n - 1)] + [high]


def _logspace(low: float, high: float, n: int) -> list[float]:
    points = [math.exp(x) for x in _linspace(math.log(low), math.log(high), n)]
    if n > 1:
        points[0], points[-1] = low, high
    return points


class Distribution(ABC):
    """Base of the distributions. Subclasses are frozen dataclasses."""

    #: The ``type`` tag in JSON.
    type_name: ClassVar[str] = ""

    @abstractmethod
    def sample(self, rng: random.Random) -> Any:
        """One value drawn with ``rng``."""

    @abstractmethod
    def grid(self, n: int) -> list:
        """Grid points: every value for a choice, ``n`` evenly spaced points otherwise."""

    @abstractmethod
    def to_json(self) -> dict[str, Any]:
        """The JSON form, e.g. ``{"type": "uniform", "low": 0.0, "high": 1.0}``."""

    @abstractmethod
    def to_optuna(self) -> Any:
        """The equivalent ``optuna.distributions.BaseDistribution``."""


@dataclass(frozen=True)
class Choice(Distribution):
    """One of a fixed tuple of JSON scalars (str, int, float, bool or null)."""

    values: tuple
    type_name: ClassVar[str] = "choice"

    def __post_init__(self) -> None:
        if isinstance(self.values, str | bytes) or not isinstance(self.values, tuple | list):
            raise SpecError("values", f"must be a list of values, got {self.values!r}")
        object.__setattr__(self, "values", tuple(self.values))
        if not self.values:
            raise SpecError("values", "must list at least one value")
        seen: list = []
        for v in self.values:
            if not isinstance(v, _CHOICE_TYPES):
                raise SpecError(
                    "values", f"must hold strings, numbers, booleans or null, got {v!r}"
                )
            # 1 == True == 1.0 in Python; compare with the type so they stay distinct.
            if (type(v), v) in seen:
                raise SpecError("values", f"lists {v!r} twice")
            seen.append((type(v), v))

    def sample(self, rng: random.Random) -> Any:
        return self.values[rng.randrange(len(self.values))]

    def grid(self, n: int) -> list:
        return list(self.values)

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type_name, "values": list(self.values)}

    def to_optuna(self) -> Any:
        from optuna.distributions import CategoricalDistribution

        return CategoricalDistribution(list(self.values))


@dataclass(frozen=True)
class Uniform(Distribution):
    """A float drawn uniformly from ``[low, high]``."""

    low: float
    high: float
    type_name: ClassVar[str] = "uniform"

    def __post_init__(self) -> None:
        _check_bounds(self.low, self.high, integer=False, log=False)

    def sample(self, rng: random.Random) -> float:
        return rng.uniform(self.low, self.high)

    def grid(self, n: int) -> list:
        return _linspace(float(self.low), float(self.high), n)

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type_name, "low": self.low, "high": self.high}

    def to_optuna(self) -> Any:
        from optuna.distributions import FloatDistribution

        return FloatDistribution(float(self.low), float(self.high))


@dataclass(frozen=True)
class LogUniform(Distribution):
    """A float whose logarithm is uniform on ``[log low, log high]``; ``low > 0``."""

    low: float
    high: float
    type_name: ClassVar[str] = "loguniform"

    def __post_init__(self) -> None:
        _check_bounds(self.low, self.high, integer=False, log=True)

    def sample(self, rng: random.Random) -> float:
        return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))

    def grid(self, n: int) -> list:
        return _logspace(float(self.low), float(self.high), n)

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type_name, "low": self.low, "high": self.high}

    def to_optuna(self) -> Any:
        from optuna.distributions import FloatDistribution

        return FloatDistribution(float(self.low), float(self.high), log=True)


@dataclass(frozen=True)
class IntUniform(Distribution):
    """An integer in ``[low, high]`` (both included), uniform or log-uniform."""

    low: int
    high: int
    log: bool = False
    type_name: ClassVar[str] = "int"

    def __post_init__(self) -> None:
        if not isinstance(self.log, bool):
            raise SpecError("log", f"must be true or false, got {self.log!r}")
        _check_bounds(self.low, self.high, integer=True, log=self.log)

    def sample(self, rng: random.Random) -> int:
        if not self.log:
            return rng.randint(self.low, self.high)
        # Widen by half a step each side so the end values get their fair share.
        x = math.exp(rng.uniform(math.log(self.low - 0.5), math.log(self.high + 0.5)))
        return min(self.high, max(self.low, round(x)))

    def grid(self, n: int) -> list:
        if n >= self.high - self.low + 1:
            return list(range(self.low, self.high + 1))
        spaced = _logspace if self.log else _linspace
        points: list[int] = []
        for x in spaced(float(self.low), float(self.high), n):
            v = min(self.high, max(self.low, round(x)))
            if v not in points:
                points.append(v)
        return points

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type_name, "low": self.low, "high": self.high, "log": self.log}

    def to_optuna(self) -> Any:
        from optuna.distributions import IntDistribution

        return IntDistribution(self.low, self.high, log=self.log)


#: JSON ``type`` tag -> (class, required keys, optional keys).
_TYPES: dict[str, tuple[type[Distribution], tuple[str, ...], tuple[str, ...]]] = {
    "choice": (Choice, ("values",), ()),
    "uniform": (Uniform, ("low", "high"), ()),
    "loguniform": (LogUniform, ("low", "high"), ()),
    "int": (IntUniform, ("low", "high"), ("log",)),
}


def distribution_from_json(d: Any, where: str) -> Distribution:
    """One distribution from its JSON form; errors name ``where.<key>``."""
    if isinstance(d, Distribution):
        return d
    if not isinstance(d, Mapping):
        raise SpecError(
            where, f"must be a mapping like {{type: uniform, low: 0, high: 1}}, got {d!r}"
        )
    kind = d.get("type")
    if kind is None:
        raise SpecError(f"{where}.type", f"is required; one of {', '.join(_TYPES)}")
    if kind not in _TYPES:
        raise SpecError(f"{where}.type", f"must be one of {', '.join(_TYPES)}, got {kind!r}")
    cls, required, optional = _TYPES[kind]
    for key in d:
        if key != "type" and key not in required + optional:
            allowed = ", ".join(("type", *required, *optional))
            raise SpecError(f"{where}.{key}", f"unknown key for type {kind}; allowed: {allowed}")
    for key in required:
        if key not in d:
            raise SpecError(f"{where}.{key}", f"is required for type {kind}")
    try:
        return cls(**{k: v for k, v in d.items() if k != "type"})
    except SpecError as e:
        raise SpecError(f"{where}.{e.field}", e.message) from None


def space_from_json(d: Any, where: str = "hyperparameters") -> dict[str, Distribution]:
    """A search space from its JSON form, e.g. ``{"lr": {"type": "uniform", ...}}``.

    Raises :class:`SpecError` naming the field, e.g. ``hyperparameters.lr.low``.
    Distribution objects already in ``d`` are kept as they are.
    """
    if not isinstance(d, Mapping):
        raise SpecError(where, f"must be a mapping of name -> distribution, got {d!r}")
    space: dict[str, Distribution] = {}
    for name, dist in d.items():
        if not isinstance(name, str) or not name:
            raise SpecError(where, f"names must be non-empty strings, got {name!r}")
        space[name] = distribution_from_json(dist, f"{where}.{name}")
    return space


def space_to_json(space: Mapping[str, Distribution]) -> dict[str, dict[str, Any]]:
    """The JSON form of a space; ``space_from_json`` reads it back to an equal space."""
    return {name: dist.to_json() for name, dist in space.items()}


__all__ = [
    "Choice",
    "Distribution",
    "IntUniform",
    "LogUniform",
    "Uniform",
    "distribution_from_json",
    "space_from_json",
    "space_to_json",
]
