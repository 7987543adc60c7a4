"""Records written to files as JSON a person can read, and read back as checked data.

What pipetune reads back after a crash (a study's journal) is data, never code: a
dataclass is written as a JSON object of its fields (enums by value, nested dataclasses
as objects), and read back against its type's annotations, field by field. A field
that is missing, unknown or of the wrong type is refused with the path to it
(``result.measurement.wall_s: expected a number, got 'x'``); nothing is unpickled.
Non-finite floats are written as JSON's common extension (``NaN``, ``Infinity``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any

from pipetune.errors import PipetuneError


class DataError(PipetuneError, ValueError):
    """A record read back does not have the shape its type says."""


def to_data(value: Any) -> Any:
    """``value`` as JSON types: dataclasses as objects of their fields, enums by value,
    tuples as lists, numpy scalars as Python numbers."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return to_data(value.value)
    if isinstance(value, Mapping):
        return {str(k): to_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [to_data(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    item = getattr(value, "item", None)  # a numpy scalar
    if callable(item):
        return to_data(item())
    raise TypeError(f"{type(value).__name__} is not JSON data")


def from_data(kind: Any, data: Any, where: str = "data") -> Any:
    """``data`` (parsed JSON) checked against type ``kind`` and built into it; raise
    :class:`DataError` naming the path ``where`` of what does not fit."""
    if kind is Any or kind is object:
        return data
    origin = typing.get_origin(kind)
    if origin is typing.Union or origin is types.UnionType:
        arms = typing.get_args(kind)
        if data is None and type(None) in arms:
            return None
        errors = []
        for arm in arms:
            if arm is type(None):
                continue
            try:
                return from_data(arm, data, where)
            except DataError as e:
                errors.append(str(e))
        raise DataError(errors[0] if len(errors) == 1 else f"{where}: fits none of {kind}")
    if origin is not None:
        return _generic(origin, typing.get_args(kind), data, where)
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return _dataclass(kind, data, where)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(data)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in kind)
            raise DataError(f"{where}: {data!r} is not one of {allowed}") from None
    return _scalar(kind, data, where)


def _scalar(kind: Any, data: Any, where: str) -> Any:
    if kind is float:
        if isinstance(data, int | float) and not isinstance(data, bool):
            return float(data)
        raise DataError(f"{where}: expected a number, got {data!r}")
    if kind is int:
        if isinstance(data, int) and not isinstance(data, bool):
            return data
        raise DataError(f"{where}: expected an integer, got {data!r}")
    if kind is bool or kind is str:
        if isinstance(data, kind):
            return data
        raise DataError(f"{where}: expected {'true/false' if kind is bool else 'a string'}, "
                        f"got {data!r}")
    if kind is type(None):
        if data is None:
            return None
        raise DataError(f"{where}: expected null, got {data!r}")
    raise DataError(f"{where}: cannot read a {kind!r}")


def _generic(origin: Any, args: tuple[Any, ...], data: Any, where: str) -> Any:
    if origin in (dict, Mapping) or (isinstance(origin, type) and issubclass(origin, Mapping)):
        if not isinstance(data, dict):
            raise DataError(f"{where}: expected an object, got {data!r}")
        value_kind = args[1] if len(args) == 2 else Any
        return {k: from_data(value_kind, v, f"{where}.{k}") for k, v in data.items()}
    if origin in (list, tuple, set, frozenset):
        if not isinstance(data, list):
            raise DataError(f"{where}: expected a list, got {data!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(data):
                raise DataError(f"{where}: expected {len(args)} items, got {len(data)}")
            return tuple(from_data(a, v, f"{where}[{i}]")
                         for i, (a, v) in enumerate(zip(args, data, strict=True)))
        item_kind = args[0] if args else Any
        return origin(from_data(item_kind, v, f"{where}[{i}]") for i, v in enumerate(data))
    raise DataError(f"{where}: cannot read a {origin!r}")


@functools.cache
def _hints(kind: type) -> dict[str, Any]:
    return typing.get_type_hints(kind)


def _dataclass(kind: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise DataError(f"{where}: expected an object, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(kind) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise DataError(f"{where}: unknown field {unknown[0]!r} for {kind.__name__}")
    hints = _hints(kind)
    values = {name: from_data(hints[name], value, f"{where}.{name}")
              for name, value in data.items()}
    missing = [n for n, f in fields.items() if n not in values
               and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise DataError(f"{where}: missing field {missing[0]!r} of {kind.__name__}")
    try:
        return kind(**values)
    except (TypeError, ValueError, PipetuneError) as e:  # the type's own checks
        raise DataError(f"{where}: {e}") from None


__all__ = ["DataError", "from_data", "to_data"]
