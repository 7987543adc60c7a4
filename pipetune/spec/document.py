"""A job document before it is a :class:`~pipetune.spec.JobSpec`: reading a job file
safely, and the limits any job data is held to (a file, or a dict from JSON or Prefect).

Job files are small: a file past :data:`MAX_FILE_BYTES`, a document nested deeper than
:data:`MAX_NESTING` or holding more than :data:`MAX_VALUES` values once YAML aliases are
expanded is refused before it can cost memory or time.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from pipetune.errors import SpecError
from pipetune.spec.messages import short

MAX_FILE_BYTES = 1 << 20
MAX_NESTING = 32
MAX_VALUES = 100_000


class _Loader(yaml.SafeLoader):
    """Safe YAML, plus floats like ``1e-3`` that YAML 1.1 would read as strings."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_job_file(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a job file (YAML or JSON), parsed safely and held to the
    limits above, but not validated as a job: what :func:`~pipetune.spec.load_spec`
    validates, and what a caller reads when it has sections of its own to take off
    first (the bench's ``bench``). Errors are :class:`SpecError` (a YAML syntax error
    names its line).

    >>> sections = read_job_file("examples/lenet_digits.yaml")   # doctest: +SKIP
    >>> sections["search"]["trials"]                             # doctest: +SKIP
    6
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError("", f"no such file: {path}") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise SpecError("", f"cannot read {path}: {e}") from None
    if len(text.encode("utf-8")) > MAX_FILE_BYTES:
        raise SpecError("", f"{path} is larger than {MAX_FILE_BYTES} bytes; job files are small")
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise SpecError("", f"nested deeper than {MAX_NESTING} levels") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError("", f"invalid YAML{where}: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise SpecError("", f"invalid YAML: {e}") from None
    if data is None:
        raise SpecError("", f"{path} is empty")
    return check_document(data)


def check_document(data: Any) -> dict[str, Any]:
    """``data`` as a dict of sections, once it is known to be a mapping within
    :func:`check_size`'s limits."""
    if not isinstance(data, Mapping):
        raise SpecError("", f"a job spec must be a mapping of sections, got {short(data)}")
    check_size(data)
    return dict(data)


def check_size(data: Any) -> None:
    """Refuse a document nested deeper than ``MAX_NESTING`` or holding more than
    ``MAX_VALUES`` values once YAML aliases are expanded (``&a [*b, *b, ...]`` grows
    exponentially), naming where it happened."""
    budget = [MAX_VALUES]

    def walk(value: Any, where: list[str]) -> None:
        budget[0] -= 1
        if budget[0] < 0:
            raise SpecError(".".join(where), f"the job holds more than {MAX_VALUES} values "
                            "(YAML aliases expand where they are used)")
        if len(where) > MAX_NESTING:
            raise SpecError(".".join(where[:MAX_NESTING]),
                            f"nested deeper than {MAX_NESTING} levels")
        if isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, [*where, str(key)[:40]])
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                walk(item, [*where, str(i)])

    walk(data, [])
