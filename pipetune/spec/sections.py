"""The sections of a job file, one model each: what a job says about its workload, its
system knobs, the search, early stopping, the objective, the in-trial system tuner and
the profiler.

Every section forbids unknown fields, so a misspelt key is an error that names it, and
checks what it can check alone; checks across sections and against the world (the
workload resolves, its metrics hold ``objective.metric``) are :class:`~pipetune.spec.JobSpec`'s.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from pipetune.errors import SpecError, SystemConfigError, WorkloadError
from pipetune.policies import check_name, scheduler_names, searcher_names
from pipetune.space import Distribution, space_from_json, space_json_schema, space_to_json
from pipetune.system.config import KNOBS, MachineInfo, SystemConfig, knob_json_schema

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


# Each type carries its JSON schema (derived from its own rules), so the JSON schema of
# a whole job is JobSpec.model_json_schema(): what a Prefect deployment enforces.
Space = Annotated[
    dict[str, Distribution],
    PlainValidator(_space_in),
    PlainSerializer(space_to_json),
    WithJsonSchema(space_json_schema()),
]
SystemConfigField = Annotated[
    SystemConfig,
    PlainValidator(_system_config_in),
    PlainSerializer(lambda c: c.to_dict()),
    WithJsonSchema(SystemConfig.json_schema()),
]
#: Candidates per knob: each a non-empty list of that knob's values.
SystemSpace = Annotated[
    dict[str, list[Any]],
    WithJsonSchema({
        "type": "object",
        "properties": {
            k: {"type": "array", "minItems": 1, "items": knob_json_schema(k)} for k in KNOBS
        },
        "additionalProperties": False,
    }),
]


def _workload_name_schema(schema: dict[str, Any]) -> None:
    """``workload.name`` in a JSON schema: a built-in or ``package.module:Class``
    (a Prefect server refuses anything else before a run is created)."""
    import re

    from pipetune.workloads import BUILTIN_WORKLOADS

    ident = r"[A-Za-z_][A-Za-z0-9_]*"
    schema["pattern"] = (
        "^(?:"
        + "|".join(re.escape(name) for name in BUILTIN_WORKLOADS)
        + rf"|{ident}(?:\.{ident})*:{ident}(?:\.{ident})*)$"
    )


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

    name: str = Field(min_length=1, max_length=512, json_schema_extra=_workload_name_schema)
    params: dict[str, Any] = Field(default_factory=dict)
    #: Seconds one epoch may run on its worker before its trial fails (a hung data
    #: loader must not stall the study and the queue behind it).
    epoch_timeout_s: float = Field(DEFAULT_EPOCH_TIMEOUT_S, gt=0, le=7 * 86400)
    #: Train and evaluate every epoch with torch's deterministic algorithms
    #: (``torch.use_deterministic_algorithms(True)``; on CUDA also
    #: ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless the worker has its own, which torch
    #: reads once per process: give CUDA workers it at start for it to hold from their
    #: first epoch). The previous setting is restored after the epoch. An op with no
    #: deterministic implementation raises, failing its trial. Cost on CPU: none
    #: measurable (LeNet-5 on the bundled digits, 5 epochs, with/without: 0.99 to 1.01,
    #: ``benchmarks/deterministic.py``). On CUDA it rules out the nondeterministic cuDNN
    #: convolution algorithms and atomic-add kernels (scatter, index_add backward), so
    #: epochs there can be slower; measure with ``--device cuda``.
    deterministic: bool = False

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


def _cores(n: int) -> str:
    return f"{n} core" if n == 1 else f"{n} cores"


def _values(values: Any) -> str:
    return ", ".join(str(v) for v in values)


@dataclass(frozen=True)
class SpaceDrop:
    """Values of one ``system.space`` knob left out of a study because the machine its
    epochs run on cannot honour them (:meth:`SystemSpec.fit`): ``reason`` says what
    that machine has."""

    knob: str
    values: tuple[Any, ...]
    reason: str

    @property
    def field(self) -> str:
        return f"system.space.{self.knob}"

    def line(self) -> str:
        """One line for a person: ``system.space.cores: 4 dropped: this machine has 2 cores``."""
        return f"{self.field}: {_values(self.values)} dropped: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: ``{"values": [...], "reason": "..."}`` (the journal, MLflow)."""
        return {"values": list(self.values), "reason": self.reason}


class SystemSpec(_Section):
    """``default``: the config epoch 1 runs under; ``space``: candidates per knob.

    A candidate is the default with one knob changed, so each value must make a
    valid config in that position. Whether they fit the machine is :meth:`fit`:
    :class:`JobSpec` validation refuses what it refuses, and the study runs the space
    it leaves on the cluster's largest worker.
    """

    default: SystemConfigField = Field(default_factory=SystemConfig)
    space: SystemSpace = Field(default_factory=dict)

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
        """Refuse what :meth:`fit` refuses on ``machine`` (default: this one); values
        it would only drop pass."""
        self.fit(machine)

    def fit(
        self, machine: MachineInfo | None = None, *, cores_note: str | None = None
    ) -> tuple[SystemSpec, tuple[SpaceDrop, ...]]:
        """This section as it can run on ``machine`` (default: this one), and what was
        left out of the space to get there.

        A space value that needs more cores than ``machine`` has is dropped (one
        :class:`SpaceDrop` per knob); the job goes on with the rest. Refused, naming
        the field: a default that does not fit, a knob none of whose values fit, and
        any value the machine cannot honour for another reason (a CUDA knob with no
        GPU, bf16 on a CPU without it). ``cores_note`` says where the core count comes
        from (default ``this machine has N cores``).

        >>> spec = SystemSpec(space={"cores": [1, 2, 4]})
        >>> fitted, drops = spec.fit(MachineInfo(cores=2))
        >>> fitted.space["cores"], drops[0].line()
        ([1, 2], 'system.space.cores: 4 dropped: this machine has 2 cores')
        """
        machine = machine or _this_machine()
        note = cores_note or f"this machine has {_cores(machine.cores)}"
        if self.default.cores > machine.cores:
            raise SystemConfigError(
                "system.default.cores", f"{self.default.cores} cores requested but {note}")
        self.default.check_machine(machine, where="system.default")
        space: dict[str, list[Any]] = {}
        drops: list[SpaceDrop] = []
        for knob, values in self.space.items():
            kept: list[Any] = []
            dropped: list[Any] = []
            for value in values:
                config = self.default.replace(**{knob: value})
                if config.cores > machine.cores:
                    dropped.append(value)
                    continue
                try:
                    config.check_machine(machine, where="system.space")
                except SystemConfigError as e:
                    raise SystemConfigError(f"system.space.{knob}", e.message) from None
                kept.append(value)
            if not kept:
                raise SystemConfigError(
                    f"system.space.{knob}", f"no value fits: {_values(dropped)} ({note})")
            space[knob] = kept
            if dropped:
                drops.append(SpaceDrop(knob, tuple(dropped), note))
        if not drops:
            return self, ()
        return self.model_copy(update={"space": space}), tuple(drops)

    def candidates(self) -> dict[str, list[SystemConfig]]:
        """Per knob, the default with that knob set to each listed value."""
        return {
            knob: [self.default.replace(**{knob: v}) for v in values]
            for knob, values in self.space.items()
        }


#: An import path ``package.module:Factory``, as a JSON schema pattern.
IMPORT_PATH_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"


def _policy_schema(built_in: tuple[str, ...], default: str) -> WithJsonSchema:
    """What a Prefect server checks a policy name against: a built-in name or an import
    path (a name registered in a program's process is that process's own)."""
    return WithJsonSchema({"anyOf": [{"enum": list(built_in)},
                                     {"type": "string", "pattern": IMPORT_PATH_PATTERN}],
                           "default": default})


class SearchSpec(_Section):
    """How hyperparameter configurations are chosen."""

    #: A built-in searcher (``random``, ``grid``, ``tpe``), one registered with
    #: :func:`pipetune.policies.register_searcher`, or ``package.module:Factory``.
    algorithm: Annotated[str, _policy_schema(searcher_names(), "tpe")] = "tpe"
    trials: int = Field(ge=1, le=100_000)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    max_concurrent: int = Field(1, ge=1, le=4096)
    grid_points: int = Field(3, ge=2)
    #: Stop the study when this many trials fail with the same error (the same
    #: exception raised at the same place) before any epoch of the study has finished:
    #: the workload's code is broken. Also when this many trials in a row fail because
    #: the checkpoint store refused their checkpoint (full, read-only), whenever that
    #: happens. ``None``: ``max_concurrent + 1``; ``0``: never.
    stop_after_failures: int | None = Field(None, ge=0, le=100_000)

    @field_validator("algorithm")
    @classmethod
    def _known_searcher(cls, value: Any) -> str:
        return check_name("search.algorithm", value, kind="searcher")

    @property
    def failure_limit(self) -> int:
        """:attr:`stop_after_failures` resolved (0: never stop)."""
        if self.stop_after_failures is None:
            return self.max_concurrent + 1
        return self.stop_after_failures


class EarlyStoppingSpec(_Section):
    """Epoch budget and early-stopping policy (``asha`` or ``none``)."""

    #: ``asha``, ``none``, one registered with
    #: :func:`pipetune.policies.register_scheduler`, or ``package.module:Factory``.
    policy: Annotated[str, _policy_schema(scheduler_names(), "asha")] = "asha"
    min_epochs: int = Field(1, ge=1)
    max_epochs: int = Field(ge=1)
    reduction_factor: int = Field(2, ge=2)

    @field_validator("policy")
    @classmethod
    def _known_scheduler(cls, value: Any) -> str:
        return check_name("early_stopping.policy", value, kind="scheduler")

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
    #: What an untried one-time knob (``compile``) is taken to cost once, in wall seconds,
    #: and the share of each epoch it saves, until this study or the ground truth has
    #: measured one (None: the priors of :mod:`pipetune.tuner.one_time`, measured here).
    one_time_price_s: float | None = Field(None, ge=0)
    one_time_saving: float | None = Field(None, ge=0, lt=1)
    #: Which compile cache epochs under ``compile`` use: empty, the shared one
    #: (``compile-cache`` under the pipetune home, or ``$PIPETUNE_COMPILE_CACHE``); a
    #: name, a folder of that name inside it (the bench gives each strategy its own).
    compile_cache: str = Field("", max_length=64, pattern=r"^([A-Za-z0-9_-][A-Za-z0-9_.-]*)?$")


class ProfilerSpec(_Section):
    """Epoch profiling: steps sampled for the operator mix, the energy model's watts
    per busy core, and whether to read hardware counters with ``perf``."""

    op_mix_steps: int = Field(10, ge=1)
    watts_per_core: float = Field(10.0, gt=0)
    perf: Literal["auto", "off"] = "auto"


class TrackingSpec(_Section):
    """Where a study is recorded besides MLflow: ``trackers``, import paths
    ``package.module:Factory`` to trackers of your own (:class:`pipetune.tracking.Tracker`),
    each called as ``Factory(spec=..., study_id=..., folder=...)`` when the study opens."""

    trackers: list[Annotated[str, WithJsonSchema(
        {"type": "string", "pattern": IMPORT_PATH_PATTERN})]] = Field(
            default_factory=list, max_length=32)

    @field_validator("trackers")
    @classmethod
    def _import_paths(cls, value: list[str]) -> list[str]:
        for i, path in enumerate(value):
            if not (isinstance(path, str) and ":" in path and check_name(
                    f"tracking.trackers[{i}]", path, kind="tracker")):
                raise SpecError(f"tracking.trackers[{i}]", "must be an import path "
                                f"package.module:Factory to a tracker of your own, got {path!r}")
        return value

