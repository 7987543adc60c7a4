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
    #: JSON schemas of the keys beside ``type``, and which are required: what a
    #: JSON-schema validator (a Prefect server checking a deployment's parameters) can
    #: check before ``__post_init__`` checks the rest (``low < high``, no repeats).
    json_keys: ClassVar[dict[str, dict[str, Any]]] = {}
    json_required: ClassVar[tuple[str, ...]] = ()

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
    json_keys: ClassVar[dict[str, dict[str, Any]]] = {
        "values": {
            "type": "array",
            "minItems": 1,
            "items": {"type": ["string", "number", "boolean", "null"]},
        }
    }
    json_required: ClassVar[tuple[str, ...]] = ("values",)

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
class _FloatRange(Distribution):
    """A float in ``[low, high]``; linear (:class:`Uniform`) or log (:class:`LogUniform`)."""

    low: float
    high: float
    json_required: ClassVar[tuple[str, ...]] = ("low", "high")
    #: Whether the logarithm is uniform (then ``low > 0``).
    _log: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_bounds(self.low, self.high, integer=False, log=self._log)

    def sample(self, rng: random.Random) -> float:
        if self._log:
            return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        return rng.uniform(self.low, self.high)

    def grid(self, n: int) -> list:
        return (_logspace if self._log else _linspace)(float(self.low), float(self.high), n)

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type_name, "low": self.low, "high": self.high}

    def to_optuna(self) -> Any:
        from optuna.distributions import FloatDistribution

        return FloatDistribution(float(self.low), float(self.high), log=self._log)


@dataclass(frozen=True)
class Uniform(_FloatRange):
    """A float drawn uniformly from ``[low, high]``."""

    type_name: ClassVar[str] = "uniform"
    json_keys: ClassVar[dict[str, dict[str, Any]]] = dict.fromkeys(
        ("low", "high"), {"type": "number"}
    )


@dataclass(frozen=True)
class LogUniform(_FloatRange):
    """A float whose logarithm is uniform on ``[log low, log high]``; ``low > 0``."""

    type_name: ClassVar[str] = "loguniform"
    json_keys: ClassVar[dict[str, dict[str, Any]]] = dict.fromkeys(
        ("low", "high"), {"type": "number", "exclusiveMinimum": 0}
    )
    _log: ClassVar[bool] = True


@dataclass(frozen=True)
class IntUniform(Distribution):
    """An integer in ``[low, high]`` (both included), uniform or log-uniform."""

    low: int
    high: int
    log: bool = False
    type_name: ClassVar[str] = "int"
    json_keys: ClassVar[dict[str, dict[str, Any]]] = {
        "low": {"type": "integer"},
        "high": {"type": "integer"},
        "log": {"type": "boolean", "default": False},
    }
    json_required: ClassVar[tuple[str, ...]] = ("low", "high")

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


_CLASSES: tuple[type[Distribution], ...] = (Choice, Uniform, LogUniform, IntUniform)

#: JSON ``type`` tag -> (class, required keys, optional keys), read off the classes.
_TYPES: dict[str, tuple[type[Distribution], tuple[str, ...], tuple[str, ...]]] = {
    cls.type_name: (
        cls,
        cls.json_required,
        tuple(k for k in cls.json_keys if k not in cls.json_required),
    )
    for cls in _CLASSES
}


def distribution_json_schema() -> dict[str, Any]:
    """The JSON schema of one distribution's JSON form, from the classes' own keys.

    Written as ``if type == X then <X's keys>`` clauses rather than ``oneOf``: a
    JSON-schema validator reports the failure of whichever ``oneOf`` branch it finds
    closest (``low is not an integer`` for a ``uniform`` missing ``high``); with
    ``if``/``then`` only the branch the tag selects is checked, so the message names the
    real problem.
    """
    return {
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"enum": list(_TYPES)}},
        "allOf": [
            {
                "if": {"properties": {"type": {"const": tag}}},
                "then": {
                    "properties": {"type": {"const": tag}, **cls.json_keys},
                    "required": list(cls.json_required),
                    "additionalProperties": False,
                },
            }
            for tag, (cls, _, _) in _TYPES.items()
        ],
    }


def space_json_schema() -> dict[str, Any]:
    """The JSON schema of a space's JSON form: at least one name -> distribution."""
    return {
        "type": "object",
        "minProperties": 1,
        "additionalProperties": distribution_json_schema(),
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
    "distribution_json_schema",
    "space_from_json",
    "space_json_schema",
    "space_to_json",
]
