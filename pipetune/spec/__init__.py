"""The job spec: one YAML file that says what to tune, how, and under which system knobs.

>>> spec = load_spec("examples/lenet_digits.yaml")          # doctest: +SKIP
>>> spec.search.trials, spec.early_stopping.max_epochs      # doctest: +SKIP
(6, 3)

Every section forbids unknown fields, so a misspelt key is an error that names it.
Every error a user can cause is a :class:`~pipetune.errors.SpecError` whose ``field``
is the dotted path (``search.trials``) and whose message says what is allowed.
Checks that need the world: the workload name must resolve (and its ``metrics`` hold
``objective.metric``), and the system configs must be ones this machine can honour: a
space value needing more cores than it has is not refused but left out when the job
runs (:meth:`JobSpec.fit`, against the cluster's largest worker); a default, or a knob
none of whose values fits, is refused.
The workload is built once from ``workload.params``: its
:class:`~pipetune.errors.WorkloadParamError` reads ``workload.params.<field>: ...``,
any other exception it raises one line under ``workload`` naming it.

The parts, each with its own reason to change:

- :mod:`pipetune.spec.document`: reading a job file safely (:func:`read_job_file`) and
  the size, nesting and alias limits any job data is held to;
- :mod:`pipetune.spec.sections`: one model per section of the file;
- :mod:`pipetune.spec.joint`: ``system.<knob>`` hyperparameters (joint tuning);
- :mod:`pipetune.spec.messages`: how a validation error reads;
- here: :class:`JobSpec`, the whole job checked against the world, and :func:`load_spec`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, model_validator

from pipetune.errors import SpecError, WorkloadError
from pipetune.modules import make_job_importable, one_line
from pipetune.space import Choice, Distribution, IntUniform
from pipetune.spec.document import (
    MAX_FILE_BYTES,
    MAX_NESTING,
    MAX_VALUES,
    check_document,
    check_size,
    read_job_file,
)
from pipetune.spec.joint import (
    SYSTEM_HPARAM_PREFIX,
    check_system_hyperparameters,
    split_system_params,
)
from pipetune.spec.messages import describe
from pipetune.spec.sections import (
    DEFAULT_EPOCH_TIMEOUT_S,
    MAX_SEED,
    EarlyStoppingSpec,
    ObjectiveSpec,
    PipetuneSpec,
    ProfilerSpec,
    SearchSpec,
    SimilaritySpec,
    Space,
    SpaceDrop,
    SystemSpec,
    TrackingSpec,
    WorkloadSpec,
    _Section,
)
from pipetune.system.config import MachineInfo

NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"
#: Longest job name (it names runs, folders and Prefect objects).
MAX_NAME_LENGTH = 128


class JobSpec(_Section):
    """A whole job file. Build with :func:`load_spec` or :meth:`from_dict`."""

    name: str = Field(pattern=NAME_PATTERN, max_length=MAX_NAME_LENGTH)
    workload: WorkloadSpec
    hyperparameters: Space
    system: SystemSpec = Field(default_factory=SystemSpec)
    search: SearchSpec
    early_stopping: EarlyStoppingSpec
    objective: ObjectiveSpec = Field(default_factory=ObjectiveSpec)
    pipetune: PipetuneSpec = Field(default_factory=PipetuneSpec)
    profiler: ProfilerSpec = Field(default_factory=ProfilerSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)

    @model_validator(mode="wrap")
    @classmethod
    def _check_world(cls, data: Any, handler: Any, info: ValidationInfo) -> JobSpec:
        # The shape is checked first, so a typo is reported before torch is imported.
        spec = handler(data)
        spec.system.check_machine((info.context or {}).get("machine"))
        workload_cls = spec.workload.resolve()
        _check_workload_params(workload_cls, spec, (info.context or {}).get("machine"))
        metrics = tuple(getattr(workload_cls, "metrics", ()))
        metric = spec.objective.metric
        if metric is None:
            if not metrics:
                raise SpecError(
                    "objective.metric", f"is required: {spec.workload.name} declares no metrics"
                )
            objective = spec.objective.model_copy(update={"metric": metrics[0]})
            spec = spec.model_copy(update={"objective": objective})
        elif metrics and metric not in metrics:
            raise SpecError(
                "objective.metric",
                f"must be one of {', '.join(metrics)} (what {spec.workload.name} reports), "
                f"got {metric!r}",
            )
        return spec

    # -- conversions ---------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any, machine: MachineInfo | None = None) -> JobSpec:
        """Validate a plain dict (parsed YAML/JSON). ``machine`` defaults to this one."""
        data = check_document(data)
        try:
            return cls.model_validate(data, context={"machine": machine})
        except ValidationError as e:
            raise spec_error_from_validation(e, cls) from None

    def fit(
        self, machine: MachineInfo | None = None, *, cores_note: str | None = None
    ) -> tuple[JobSpec, tuple[SpaceDrop, ...]]:
        """This job as it can run on ``machine`` (default: this one), and what was left
        out of ``system.space`` to get there (:meth:`SystemSpec.fit`: space values that
        need more cores than the machine has). With nothing to leave out, the answer is
        this very spec. Refuses, naming the field, what cannot run at all.

        >>> fitted, drops = spec.fit(MachineInfo(cores=1))         # doctest: +SKIP
        >>> [d.line() for d in drops]                               # doctest: +SKIP
        ['system.space.cores: 2 dropped: this machine has 1 core']
        """
        system, drops = self.system.fit(machine, cores_note=cores_note)
        if not drops:
            return self, ()
        return self.model_copy(update={"system": system}), drops

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data; ``from_dict`` reads it back to an equal spec."""
        return self.model_dump(mode="json")

    def with_overrides(
        self,
        trials: int | None = None,
        pipetune_enabled: bool | None = None,
        machine: MachineInfo | None = None,
    ) -> JobSpec:
        """A revalidated copy with ``search.trials`` / ``pipetune.enabled`` replaced,
        checked against ``machine`` (default: this one).

        An override that is ``None`` or already the spec's value changes nothing; with
        nothing to change, the answer is this very spec, not a copy:

        >>> spec.with_overrides(trials=spec.search.trials) is spec   # doctest: +SKIP
        True
        """
        if _unchanged(trials, self.search.trials) and _unchanged(
            pipetune_enabled, self.pipetune.enabled
        ):
            return self
        data = self.to_dict()
        if trials is not None:
            data["search"]["trials"] = trials
        if pipetune_enabled is not None:
            data["pipetune"]["enabled"] = pipetune_enabled
        return JobSpec.from_dict(data, machine=machine)


def _unchanged(override: Any, current: Any) -> bool:
    # Same type too: the fields are strict, so ``True`` for trials=1 or ``2.0`` for
    # trials=2 is not the current value but one that revalidation must refuse.
    return override is None or (type(override) is type(current) and override == current)


def _check_workload_params(workload_cls: type, spec: JobSpec,
                           machine: MachineInfo | None = None) -> None:
    """Build the workload once (construction is cheap by contract and checks its params)
    and, where the class lists its hyperparameters, check the space's names."""
    try:
        workload_cls(**spec.workload.params)
    except SpecError:  # a WorkloadParamError among them: workload.params.<field>
        raise
    except WorkloadError as e:
        raise SpecError("workload.params", str(e)) from None
    except TypeError as e:
        raise SpecError("workload.params", f"{one_line(e)} ({workload_cls.__name__})") from None
    except Exception as e:  # noqa: BLE001 - the workload's own code: one line, no traceback
        # (pydantic would wrap a ValueError raised here with the whole job as its input)
        raise SpecError(
            "workload", f"{spec.workload.name} failed to build from workload.params: "
            f"{one_line(e)}") from None
    check_system_hyperparameters(spec, machine)
    known = getattr(workload_cls, "hparam_specs", None)
    if isinstance(known, Mapping) and known:
        for name, dist in spec.hyperparameters.items():
            if name.startswith(SYSTEM_HPARAM_PREFIX):
                continue
            if name not in known:
                raise SpecError(
                    f"hyperparameters.{name}",
                    f"not a hyperparameter of {spec.workload.name}; allowed: {', '.join(known)}",
                )
            coerce = getattr(known[name], "coerce", None)
            if coerce is not None:  # every value the search can draw is one it accepts
                for value in _extremes(dist):
                    try:
                        coerce(f"hyperparameters.{name}", value)
                    except SpecError:
                        raise
                    except Exception as e:  # noqa: BLE001 - a workload's own check
                        raise SpecError(f"hyperparameters.{name}",
                                        f"{value!r} refused: {one_line(e)}") from None


def _extremes(dist: Distribution) -> list[Any]:
    """The values of ``dist`` a range check must accept: every choice, a range's ends
    (a continuous range's top is never drawn exactly: checked just below it)."""
    if isinstance(dist, Choice):
        return list(dist.values)
    if isinstance(dist, IntUniform):
        return [dist.low, dist.high]
    low, high = getattr(dist, "low", None), getattr(dist, "high", None)
    if low is None or high is None:
        return []
    return [low, math.nextafter(high, -math.inf) if high > low else high]


def spec_error_from_validation(
    error: ValidationError, root: type[BaseModel] = JobSpec, prefix: str = ""
) -> SpecError:
    """One :class:`SpecError` for the first problem pydantic found.

    ``field`` is the dotted location (``search.trials``), the message says what is
    allowed: ``must be >= 1, got 0``.
    """
    first = error.errors(include_url=False)[0]
    loc = [str(p) for p in first["loc"] if p != "[key]"]
    field = ".".join(([prefix] if prefix else []) + loc)
    return SpecError(field, describe(first, root))


def load_spec(path: str | Path, machine: MachineInfo | None = None) -> JobSpec:
    """Read and validate a job file: :func:`read_job_file`, then
    :meth:`JobSpec.from_dict`. Errors are :class:`SpecError` (a YAML syntax error names
    its line).

    A job naming its own workload module (``mymod:MyWorkload``) finds it in the job
    file's folder or the working folder (:func:`pipetune.modules.make_job_importable`).
    """
    data = read_job_file(path)
    make_job_importable(path, data)  # its own workload module may sit beside it
    return JobSpec.from_dict(data, machine=machine)


__all__ = [
    "DEFAULT_EPOCH_TIMEOUT_S",
    "MAX_FILE_BYTES",
    "MAX_NAME_LENGTH",
    "MAX_NESTING",
    "MAX_SEED",
    "MAX_VALUES",
    "NAME_PATTERN",
    "SYSTEM_HPARAM_PREFIX",
    "EarlyStoppingSpec",
    "JobSpec",
    "ObjectiveSpec",
    "PipetuneSpec",
    "ProfilerSpec",
    "SearchSpec",
    "SimilaritySpec",
    "SpaceDrop",
    "SystemSpec",
    "TrackingSpec",
    "WorkloadSpec",
    "check_size",
    "load_spec",
    "read_job_file",
    "spec_error_from_validation",
    "split_system_params",
]
