"""The job spec: one YAML file that says what to tune, how, and under which system knobs.

>>> spec = load_spec("examples/lenet_digits.yaml")          # doctest: +SKIP
>>> spec.search.trials, spec.early_stopping.max_epochs      # doctest: +SKIP
(6, 3)

Every section forbids unknown fields, so a misspelt key is an error that names it.
Every error a user can cause is a :class:`~pipetune.errors.SpecError` whose ``field``
is the dotted path (``search.trials``) and whose message says what is allowed.
Checks that need the world: the workload name must resolve (and its ``metrics`` hold
``objective.metric``), and every system config must be one this machine can honour.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pipetune.errors import SpecError, SystemConfigError, WorkloadError
from pipetune.space import Distribution, space_from_json, space_to_json
from pipetune.system.config import KNOBS, MachineInfo, SystemConfig

NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"
#: Longest job name (it names runs, folders and Prefect objects).
MAX_NAME_LENGTH = 128
#: Job files are small: anything past these is refused before it can cost memory.
MAX_FILE_BYTES = 1 << 20
MAX_NESTING = 32
MAX_VALUES = 100_000
#: Searcher seeds: what numpy's and Optuna's generators accept.
MAX_SEED = 2**32 - 1


# -- field types with their own validation ---------------------------------------------


def _relocate(e: SpecError, where: str) -> SpecError:
    """``e`` re-aimed from ``system.<knob>`` (how SystemConfig names it) to ``where.<knob>``."""
    knob = e.field.removeprefix("system.")
    return type(e)(f"{where}.{knob}" if knob else where, e.message)


def _space_in(value: Any) -> dict[str, Distribution]:
    space = space_from_json(value, "hyperparameters")
    if not space:
        raise SpecError("hyperparameters", "must name at least one hyperparameter to tune")
    return space


def _system_config_in(value: Any) -> SystemConfig:
    if isinstance(value, SystemConfig):
        return value
    if not isinstance(value, Mapping):
        raise SpecError("system.default", f"must be a mapping of knob -> value, got {value!r}")
    try:
        return SystemConfig.from_dict(dict(value))
    except SystemConfigError as e:
        raise _relocate(e, "system.default") from None


Space = Annotated[
    dict[str, Distribution], PlainValidator(_space_in), PlainSerializer(space_to_json)
]
SystemConfigField = Annotated[
    SystemConfig,
    PlainValidator(_system_config_in),
    PlainSerializer(lambda c: c.to_dict()),
]


@functools.cache
def _this_machine() -> MachineInfo:
    return MachineInfo.detect()


# -- sections --------------------------------------------------------------------------


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, arbitrary_types_allowed=True
    )


#: Generous: an hour per epoch; jobs with longer epochs say so.
DEFAULT_EPOCH_TIMEOUT_S = 3600.0


class WorkloadSpec(_Section):
    """``name``: a built-in (``lenet5``) or an import path ``package.module:Class``;
    ``params``: keyword arguments for the class."""

    name: str = Field(min_length=1, max_length=512)
    params: dict[str, Any] = Field(default_factory=dict)
    #: Seconds one epoch may run on its worker before its trial fails (a hung data
    #: loader must not stall the study and the queue behind it).
    epoch_timeout_s: float = Field(DEFAULT_EPOCH_TIMEOUT_S, gt=0, le=7 * 86400)

    @field_validator("params")
    @classmethod
    def _json_params(cls, value: dict[str, Any]) -> dict[str, Any]:
        # Params travel as JSON (Prefect parameters, MLflow, Dask), where mapping keys are
        # strings: normalise once here so a spec equals itself after a round trip.
        try:
            return json.loads(json.dumps(value))
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"must be plain JSON values (numbers, strings, lists, maps): {e}"
            ) from None

    def resolve(self) -> type:
        """The :class:`~pipetune.workloads.Workload` subclass ``name`` refers to."""
        from pipetune.workloads import resolve_workload

        try:
            return resolve_workload(self.name)
        except WorkloadError as e:
            raise SpecError("workload.name", str(e)) from None

    def build(self) -> Any:
        """A fresh workload instance: ``resolve()(**params)``."""
        return self.resolve()(**self.params)


class SystemSpec(_Section):
    """``default``: the config epoch 1 runs under; ``space``: candidates per knob.

    A candidate is the default with one knob changed, so each value must make a
    valid config in that position. Whether they fit the machine is
    :meth:`check_machine`, which :class:`JobSpec` validation calls.
    """

    default: SystemConfigField = Field(default_factory=SystemConfig)
    space: dict[str, list[Any]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _valid_candidates(self) -> SystemSpec:
        for knob, values in self.space.items():
            where = f"system.space.{knob}"
            if knob not in KNOBS:
                raise SpecError(where, f"unknown knob; allowed: {', '.join(KNOBS)}")
            if not values:
                raise SpecError(where, "must list at least one value")
            for i, v in enumerate(values):
                if any(type(v) is type(w) and v == w for w in values[:i]):
                    raise SpecError(where, f"lists {v!r} twice")
                try:
                    self.default.replace(**{knob: v})
                except SystemConfigError as e:
                    raise SystemConfigError(where, e.message) from None
        return self

    def check_machine(self, machine: MachineInfo | None = None) -> None:
        """Reject a default or candidate config ``machine`` (default: this one) cannot
        honour, naming ``system.default.<knob>`` or ``system.space.<knob>``."""
        machine = machine or _this_machine()
        self.default.check_machine(machine, where="system.default")
        for knob, configs in self.candidates().items():
            for config in configs:
                try:
                    config.check_machine(machine, where="system.space")
                except SystemConfigError as e:
                    raise SystemConfigError(f"system.space.{knob}", e.message) from None

    def candidates(self) -> dict[str, list[SystemConfig]]:
        """Per knob, the default with that knob set to each listed value."""
        return {
            knob: [self.default.replace(**{knob: v}) for v in values]
            for knob, values in self.space.items()
        }


class SearchSpec(_Section):
    """How hyperparameter configurations are chosen."""

    algorithm: Literal["random", "grid", "tpe"] = "tpe"
    trials: int = Field(ge=1, le=100_000)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    max_concurrent: int = Field(1, ge=1, le=4096)
    grid_points: int = Field(3, ge=2)


class EarlyStoppingSpec(_Section):
    """Epoch budget and early-stopping policy (``asha`` or ``none``)."""

    policy: Literal["asha", "none"] = "asha"
    min_epochs: int = Field(1, ge=1)
    max_epochs: int = Field(ge=1)
    reduction_factor: int = Field(2, ge=2)

    @model_validator(mode="after")
    def _min_below_max(self) -> EarlyStoppingSpec:
        if self.min_epochs > self.max_epochs:
            raise SpecError(
                "early_stopping.min_epochs",
                f"must be <= max_epochs ({self.max_epochs}), got {self.min_epochs}",
            )
        return self


class ObjectiveSpec(_Section):
    """``metric`` to optimise (default: the workload's first metric) in ``mode``;
    ``system``: what the system tuner minimises per sample, ``time`` or ``energy``."""

    metric: str | None = None
    mode: Literal["max", "min"] = "max"
    system: Literal["time", "energy"] = "time"


class SimilaritySpec(_Section):
    """Ground-truth clustering: at most ``max_clusters`` k-means clusters; a profile is
    new when farther from its centroid than ``max(min_bound, bound_factor * spread)``."""

    max_clusters: int = Field(8, ge=1)
    bound_factor: float = Field(2.0, gt=0)
    min_bound: float = Field(2.0, gt=0)


class PipetuneSpec(_Section):
    """The in-trial system tuner: on or off, how it probes, how it matches profiles."""

    enabled: bool = True
    probe_plan: Literal["one_knob"] = "one_knob"
    max_probes: int | None = Field(None, ge=1)
    similarity: SimilaritySpec = Field(default_factory=SimilaritySpec)


class ProfilerSpec(_Section):
    """Epoch profiling: steps sampled for the operator mix, the energy model's watts
    per busy core, and whether to read hardware counters with ``perf``."""

    op_mix_steps: int = Field(10, ge=1)
    watts_per_core: float = Field(10.0, gt=0)
    perf: Literal["auto", "off"] = "auto"


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

    @model_validator(mode="wrap")
    @classmethod
    def _check_world(cls, data: Any, handler: Any, info: ValidationInfo) -> JobSpec:
        # The shape is checked first, so a typo is reported before torch is imported.
        spec = handler(data)
        spec.system.check_machine((info.context or {}).get("machine"))
        workload_cls = spec.workload.resolve()
        _check_workload_params(workload_cls, spec)
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
        if not isinstance(data, Mapping):
            raise SpecError("", "a job spec must be a mapping of sections, got "
                            f"{_short(data)}")
        check_size(data)
        try:
            return cls.model_validate(dict(data), context={"machine": machine})
        except ValidationError as e:
            raise spec_error_from_validation(e, cls) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data; ``from_dict`` reads it back to an equal spec."""
        return self.model_dump(mode="json")

    def with_overrides(
        self,
        trials: int | None = None,
        pipetune_enabled: bool | None = None,
        machine: MachineInfo | None = None,
    ) -> JobSpec:
        """A revalidated copy with ``search.trials`` / ``pipetune.enabled`` replaced."""
        data = self.to_dict()
        if trials is not None:
            data["search"]["trials"] = trials
        if pipetune_enabled is not None:
            data["pipetune"]["enabled"] = pipetune_enabled
        return JobSpec.from_dict(data, machine=machine)


def _check_workload_params(workload_cls: type, spec: JobSpec) -> None:
    """Build the workload once (construction is cheap by contract and checks its params)
    and, where the class lists its hyperparameters, check the space's names."""
    try:
        workload_cls(**spec.workload.params)
    except SpecError:
        raise
    except WorkloadError as e:
        raise SpecError("workload.params", str(e)) from None
    except TypeError as e:
        raise SpecError("workload.params", f"{e} ({workload_cls.__name__})") from None
    _check_system_hyperparameters(spec)
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
                    coerce(f"hyperparameters.{name}", value)


def _extremes(dist: Distribution) -> list[Any]:
    """The values of ``dist`` a range check must accept: every choice, a range's ends
    (a continuous range's top is never drawn exactly: checked just below it)."""
    import math

    from pipetune.space import Choice, IntUniform

    if isinstance(dist, Choice):
        return list(dist.values)
    if isinstance(dist, IntUniform):
        return [dist.low, dist.high]
    low, high = getattr(dist, "low", None), getattr(dist, "high", None)
    if low is None or high is None:
        return []
    return [low, math.nextafter(high, -math.inf) if high > low else high]


#: Hyperparameters named ``system.<knob>`` put a system knob into the search space
#: (the paper's V2 baseline, joint tuning): the trial runs every epoch under it.
SYSTEM_HPARAM_PREFIX = "system."


def _check_system_hyperparameters(spec: JobSpec) -> None:
    from pipetune.space import Choice
    from pipetune.system.config import KNOBS, SystemConfig

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
                config.check_machine(where=where)
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


# -- errors ----------------------------------------------------------------------------


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    cls = root
    for part in loc:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        cls = ann
    return cls


def _describe(error: Mapping[str, Any], root: type[BaseModel]) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    got = f", got {_short(error.get('input'))}"
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        model = _model_at(root, tuple(error["loc"][:-1]))
        allowed = f"; allowed: {', '.join(model.model_fields)}" if model else ""
        return f"unknown field{allowed}"
    bounds = {
        "greater_than_equal": (">=", "ge"),
        "greater_than": (">", "gt"),
        "less_than_equal": ("<=", "le"),
        "less_than": ("<", "lt"),
    }
    if kind in bounds:
        op, key = bounds[kind]
        return f"must be {op} {ctx.get(key)}{got}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}{got}"
    if kind == "string_pattern_mismatch":
        pattern = str(ctx.get("pattern", "")).removeprefix("^").removesuffix("$")
        return f"must match the pattern {pattern}{got}"
    if kind == "string_too_short":
        return f"must not be empty{got}"
    words = {
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
    if kind in words:
        return f"must be {words[kind]}{got}"
    msg = str(error.get("msg", "invalid"))
    return f"{msg[:1].lower()}{msg[1:]}{got}"


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
    return SpecError(field, _describe(first, root))


# -- files -----------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """Safe YAML, plus floats like ``1e-3`` that YAML 1.1 would read as strings."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_spec(path: str | Path, machine: MachineInfo | None = None) -> JobSpec:
    """Read and validate a job file. Errors are :class:`SpecError` (a YAML syntax
    error names its line)."""
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
    return JobSpec.from_dict(data, machine=machine)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({type(value).__name__})"


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


__all__ = [
    "EarlyStoppingSpec",
    "JobSpec",
    "ObjectiveSpec",
    "PipetuneSpec",
    "ProfilerSpec",
    "SearchSpec",
    "SimilaritySpec",
    "SystemSpec",
    "WorkloadSpec",
    "load_spec",
    "spec_error_from_validation",
]
