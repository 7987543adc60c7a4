"""Joint tuning (the paper's V2 baseline): hyperparameters named ``system.<knob>`` put a
system knob into the search space, and the trial runs every epoch under the value drawn.

The rule for such names lives here: which ones a job may hold
(:func:`check_system_hyperparameters`) and how a trial's params split back into workload
hyperparameters and a system config (:func:`split_system_params`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pipetune.errors import SpecError
from pipetune.space import Choice
from pipetune.system.config import KNOBS, MachineInfo, SystemConfig

if TYPE_CHECKING:
    from pipetune.spec import JobSpec

SYSTEM_HPARAM_PREFIX = "system."


def check_system_hyperparameters(spec: JobSpec, machine: MachineInfo | None = None) -> None:
    """Refuse ``system.<knob>`` hyperparameters unless pipetune is off, the knob exists,
    and every value is a choice that makes a config ``machine`` (default: this one) can
    honour."""
    names = [n for n in spec.hyperparameters if n.startswith(SYSTEM_HPARAM_PREFIX)]
    if not names:
        return
    if spec.pipetune.enabled:
        raise SpecError(
            "pipetune.enabled",
            "system knobs in the hyperparameter space (joint tuning) need pipetune.enabled: false",
        )
    for name in names:
        knob = name[len(SYSTEM_HPARAM_PREFIX):]
        where = f"hyperparameters.{name}"
        if knob not in KNOBS:
            raise SpecError(where, f"unknown system knob {knob!r}; allowed: {', '.join(KNOBS)}")
        dist = spec.hyperparameters[name]
        if not isinstance(dist, Choice):
            raise SpecError(where, "a system knob must be a choice of values")
        for value in dist.values:
            try:
                config = SystemConfig.from_dict({**spec.system.default.to_dict(), knob: value})
                config.check_machine(machine, where=where)
            except SpecError as e:
                raise SpecError(where, f"value {value!r}: {e.message}") from None


def split_system_params(
    params: Mapping[str, Any], default: Any
) -> tuple[dict[str, Any], Any | None]:
    """Split a trial's params into workload hyperparameters and, when the space holds
    ``system.<knob>`` entries, the trial's fixed :class:`SystemConfig` (else None)."""
    hparams = {k: v for k, v in params.items() if not k.startswith(SYSTEM_HPARAM_PREFIX)}
    knobs = {k[len(SYSTEM_HPARAM_PREFIX):]: v for k, v in params.items()
             if k.startswith(SYSTEM_HPARAM_PREFIX)}
    return hparams, (default.replace(**knobs) if knobs else None)
