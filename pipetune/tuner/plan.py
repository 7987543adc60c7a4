"""The system tuner's probe plan: which configs a trial may probe, from the job's
``system.space`` and default, and the space's own checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pipetune.errors import SpecError, SystemConfigError
from pipetune.system.config import CUDA_KNOBS, KNOBS, MachineInfo, SystemConfig

#: Probe plans the tuner knows.
PLANS: tuple[str, ...] = ("one_knob",)

#: Dotted prefix used when a value of the system search space is rejected.
SPACE_FIELD = "system.space"


def probe_plan(default: SystemConfig, space: Mapping[str, tuple[Any, ...]],
               machine: MachineInfo, *, max_cores: int | None = None,
               max_probes: int | None = None) -> tuple[tuple[SystemConfig, ...], list[str]]:
    """The ``one_knob`` plan: from ``default``, each other value of each knob of the
    (normalised) ``space``, in order; and what was left out, as ``"knob=value: why"``
    (invalid with the default, more than ``machine`` or ``max_cores`` allow, over
    ``max_probes``)."""
    planned: list[SystemConfig] = []
    dropped: list[str] = []
    for knob, values in space.items():
        for value in values:
            if same_value(value, getattr(default, knob)):
                continue
            try:
                candidate = default.replace(**{knob: value})
                candidate.check_machine(machine, where=SPACE_FIELD)
            except SystemConfigError as err:
                dropped.append(f"{knob}={value!r}: {err.message}")
                continue
            if max_cores is not None and candidate.cores > max_cores:
                dropped.append(
                    f"{knob}={value!r}: reserves more than {max_cores} core(s), "
                    "what a trial can hold while trials run side by side")
                continue
            if candidate not in planned:
                planned.append(candidate)
    if max_probes is not None:
        for extra in planned[max_probes:]:
            dropped.append(f"{describe_change(default, extra)}: over max_probes")
        planned = planned[:max_probes]
    return tuple(planned), dropped


def describe_change(default: SystemConfig, config: SystemConfig) -> str:
    """The knobs where ``config`` differs from ``default``, e.g. ``cores=2``."""
    changed = [
        f"{k}={getattr(config, k)}"
        for k in KNOBS
        if not same_value(getattr(config, k), getattr(default, k))
    ]
    return ", ".join(changed) if changed else "default"


def normalise_space(space: Mapping[str, Sequence[Any]]) -> dict[str, tuple[Any, ...]]:
    if not isinstance(space, Mapping):
        raise SpecError(SPACE_FIELD, f"must be a mapping of knob -> values, got {space!r}")
    unknown = sorted(set(space) - set(KNOBS))
    if unknown:
        raise SpecError(f"{SPACE_FIELD}.{unknown[0]}", f"unknown knob; allowed: {', '.join(KNOBS)}")
    out: dict[str, tuple[Any, ...]] = {}
    for knob in KNOBS:
        if knob not in space:
            continue
        values = space[knob]
        field = f"{SPACE_FIELD}.{knob}"
        if isinstance(values, str | bytes) or not isinstance(values, Sequence) or not values:
            raise SpecError(field, f"must be a non-empty list of values, got {values!r}")
        kept: list[Any] = []
        for value in values:
            check_knob_value(knob, value, field)
            if not any(same_value(value, v) for v in kept):
                kept.append(value)
        out[knob] = tuple(kept)
    return out


def check_knob_value(knob: str, value: Any, field: str) -> None:
    """Reject a value that is malformed on its own (not merely unusable with the default)."""
    base = {"device": "cuda"} if knob in (*CUDA_KNOBS, "precision") else {}
    try:
        SystemConfig(**{**base, knob: value})
    except SystemConfigError as err:
        raise SpecError(field, err.message) from None


def same_value(a: Any, b: Any) -> bool:
    # True == 1 in Python; a knob value of the wrong type is a different value.
    return type(a) is type(b) and a == b
