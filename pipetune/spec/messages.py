"""How a pydantic validation error reads to the user: one line naming what is allowed.

:func:`describe` turns pydantic's first error into ``must be >= 1, got 0``;
:func:`pipetune.spec.spec_error_from_validation` puts the dotted field in front.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

_BOUNDS = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}
_WORDS = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "list_type": "a list",
}

#: Errors a validator raised itself (pydantic wraps a ValueError or an assert in them).
_RAISED = ("value_error", "assertion_error")


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut at ``limit`` characters with the type named after the cut."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({type(value).__name__})"


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    cls = root
    for part in loc:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        cls = ann
    return cls


def describe(error: Mapping[str, Any], root: type[BaseModel]) -> str:
    """What one pydantic error (an item of ``ValidationError.errors()``) means for the
    field it names: ``is required``, ``unknown field; allowed: ...``, ``must be ...``."""
    kind = error["type"]
    ctx = error.get("ctx") or {}
    got = f", got {short(error.get('input'))}"
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        model = _model_at(root, tuple(error["loc"][:-1]))
        allowed = f"; allowed: {', '.join(model.model_fields)}" if model else ""
        return f"unknown field{allowed}"
    if kind in _BOUNDS:
        op, key = _BOUNDS[kind]
        return f"must be {op} {ctx.get(key)}{got}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}{got}"
    if kind == "string_pattern_mismatch":
        pattern = str(ctx.get("pattern", "")).removeprefix("^").removesuffix("$")
        return f"must match the pattern {pattern}{got}"
    if kind == "string_too_short":
        return f"must not be empty{got}"
    if kind in _WORDS:
        return f"must be {_WORDS[kind]}{got}"
    if not error.get("loc"):  # about the whole job: its input is the whole job, not shown
        got = ""
    if kind in _RAISED and ctx.get("error") is not None:  # a validator's own words
        return f"{' '.join(str(ctx['error']).split())}{got}"
    msg = str(error.get("msg", "invalid"))
    return f"{msg[:1].lower()}{msg[1:]}{got}"
