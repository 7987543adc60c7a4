"""The study flow's parameters as typed models, so Prefect can check them at run creation.

A deployment created with ``enforce_parameter_schema: true`` stores the JSON schema of
the flow's signature; the Prefect server checks every new flow run's parameters
against it and refuses the run (HTTP 409, nothing scheduled, nothing recorded) when
they do not fit. These models give that schema its teeth:

- ``trials`` must be an integer >= 1 (:data:`TrialsOverride`);
- ``job`` is either a job file path ending in ``.yaml``/``.yml`` or an inline job
  (:class:`JobParameter`) whose workload name must be a built-in or an import path
  ``package.module:Class``, and whose hyperparameter space is a mapping of
  distributions discriminated by ``type`` (``choice``, ``uniform``, ``loguniform``,
  ``int``), each with exactly its own keys.

The models mirror the shape of :class:`pipetune.spec.JobSpec`; they check what a
JSON schema can express. The flow still builds a :class:`~pipetune.spec.JobSpec`
from the value (cross-field rules, the machine, the workload's own parameters), so a
value that passes here can still be refused there, before anything is recorded.

>>> from pydantic import TypeAdapter
>>> TypeAdapter(JobArgument).validate_python("examples/lenet_digits.yaml")
'examples/lenet_digits.yaml'
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from pipetune.spec import NAME_PATTERN
from pipetune.workloads import BUILTIN_WORKLOADS

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"

#: A built-in workload name or an import path ``package.module:Class``.
WORKLOAD_PATTERN = (
    "^(?:"
    + "|".join(re.escape(name) for name in BUILTIN_WORKLOADS)
    + rf"|{_IDENT}(?:\.{_IDENT})*:{_IDENT}(?:\.{_IDENT})*)$"
)

#: A job file: a path ending in ``.yaml`` or ``.yml``, read by the flow run from its
#: working directory (a deployment's is the folder it was deployed from).
JOB_FILE_PATTERN = r"^\S(?:.*\S)?\.ya?ml$"


class _Param(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- hyperparameter distributions (pipetune.space) -----------------------------------


class ChoiceParam(_Param):
    """One of ``values`` (strings, numbers, booleans or null)."""

    type: Literal["choice"]
    values: list[str | int | float | bool | None] = Field(min_length=1)


class UniformParam(_Param):
    """A float uniform on ``[low, high]``."""

    type: Literal["uniform"]
    low: float
    high: float


class LogUniformParam(_Param):
    """A float log-uniform on ``[low, high]``, both > 0."""

    type: Literal["loguniform"]
    low: float = Field(gt=0)
    high: float = Field(gt=0)


class IntParam(_Param):
    """An integer in ``[low, high]``, uniform or (``log: true``) log-uniform."""

    type: Literal["int"]
    low: int
    high: int
    log: bool = False


class _SchemaByTypeTag:
    """Writes a ``type``-discriminated union's JSON schema as ``if type == X then
    <X's schema>`` clauses instead of ``oneOf``.

    A JSON-schema validator (Prefect's server uses ``jsonschema``) does not read
    pydantic's ``discriminator`` hint: with ``oneOf`` it reports the failure of
    whichever branch it finds closest, e.g. ``low is not an integer`` for a
    ``uniform`` missing ``high``. With ``if``/``then`` only the branch the tag
    selects is checked, so the message names the real problem.
    """

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict[str, Any]:
        union = handler(core_schema)
        mapping: dict[str, Any] = union.get("discriminator", {}).get("mapping", {})
        if not mapping:  # pragma: no cover - pydantic always maps tagged unions
            return union
        return {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"enum": list(mapping)}},
            "allOf": [
                {"if": {"properties": {"type": {"const": tag}}}, "then": {"$ref": ref}}
                for tag, ref in mapping.items()
            ],
        }


DistributionParam = Annotated[
    ChoiceParam | UniformParam | LogUniformParam | IntParam,
    Field(discriminator="type"),
    _SchemaByTypeTag(),
]


# -- sections (pipetune.spec) ---------------------------------------------------------


class WorkloadParam(_Param):
    """``name``: a built-in (``lenet5``, ``textcnn``, ``synthetic``) or
    ``package.module:Class``; ``params``: keyword arguments for the class."""

    name: str = Field(pattern=WORKLOAD_PATTERN)
    params: dict[str, Any] = Field(default_factory=dict)
    epoch_timeout_s: float = Field(3600.0, gt=0, le=7 * 86400)


class SystemDefaultParam(_Param):
    """The system config epoch 1 runs under (knobs left out keep their defaults)."""

    cores: int = Field(1, ge=1)
    interop_threads: int = Field(1, ge=1)
    dataloader_workers: int = Field(0, ge=0)
    omp_wait_policy: Literal["inherit", "passive", "active"] = "inherit"
    pin_cores: bool = False
    device: Literal["cpu", "cuda"] = "cpu"
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    tf32: bool = False
    cudnn_benchmark: bool = False
    channels_last: bool = False


class SystemSpaceParam(_Param):
    """Candidate values per knob; each must make a valid config in that position."""

    cores: list[Annotated[int, Field(ge=1)]] | None = Field(None, min_length=1)
    interop_threads: list[Annotated[int, Field(ge=1)]] | None = Field(None, min_length=1)
    dataloader_workers: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)
    omp_wait_policy: list[Literal["inherit", "passive", "active"]] | None = Field(
        None, min_length=1)
    pin_cores: list[bool] | None = Field(None, min_length=1)
    device: list[Literal["cpu", "cuda"]] | None = Field(None, min_length=1)
    precision: list[Literal["fp32", "bf16", "fp16"]] | None = Field(None, min_length=1)
    tf32: list[bool] | None = Field(None, min_length=1)
    cudnn_benchmark: list[bool] | None = Field(None, min_length=1)
    channels_last: list[bool] | None = Field(None, min_length=1)


class SystemParam(_Param):
    default: SystemDefaultParam | None = None
    space: SystemSpaceParam | None = None


class SearchParam(_Param):
    algorithm: Literal["random", "grid", "tpe"] = "tpe"
    trials: int = Field(ge=1, le=100_000)
    seed: int = Field(0, ge=0, le=2**32 - 1)
    max_concurrent: int = Field(1, ge=1, le=4096)
    grid_points: int = Field(3, ge=2)


class EarlyStoppingParam(_Param):
    policy: Literal["asha", "none"] = "asha"
    min_epochs: int = Field(1, ge=1)
    max_epochs: int = Field(ge=1)
    reduction_factor: int = Field(2, ge=2)


class ObjectiveParam(_Param):
    metric: str | None = None
    mode: Literal["max", "min"] = "max"
    system: Literal["time", "energy"] = "time"


class SimilarityParam(_Param):
    max_clusters: int = Field(8, ge=1)
    bound_factor: float = Field(2.0, gt=0)
    min_bound: float = Field(2.0, gt=0)


class PipetuneParam(_Param):
    enabled: bool = True
    probe_plan: Literal["one_knob"] = "one_knob"
    max_probes: int | None = Field(None, ge=1)
    similarity: SimilarityParam | None = None


class ProfilerParam(_Param):
    op_mix_steps: int = Field(10, ge=1)
    watts_per_core: float = Field(10.0, gt=0)
    perf: Literal["auto", "off"] = "auto"


class JobParameter(_Param):
    """An inline job spec: the same sections and fields as a job YAML file."""

    name: str = Field(pattern=NAME_PATTERN)
    workload: WorkloadParam
    hyperparameters: dict[str, DistributionParam] = Field(min_length=1)
    system: SystemParam | None = None
    search: SearchParam
    early_stopping: EarlyStoppingParam
    objective: ObjectiveParam | None = None
    pipetune: PipetuneParam | None = None
    profiler: ProfilerParam | None = None


def _as_plain_dict(job: JobParameter) -> dict[str, Any]:
    # The flow hands a plain dict to JobSpec, with only what the caller gave: JobSpec
    # owns the defaults, so a default that drifted here cannot override it.
    return job.model_dump(mode="json", exclude_unset=True)


#: The ``job`` parameter: an inline job (checked, then passed on as a plain dict) or
#: the path of a job file.
JobArgument = (
    Annotated[JobParameter, AfterValidator(_as_plain_dict)]
    | Annotated[str, Field(pattern=JOB_FILE_PATTERN)]
)

#: ``trials``: overrides ``search.trials``; at least 1.
TrialsOverride = Annotated[int, Field(ge=1)] | None

#: ``core_budget``: cores the executor offers at once; at least 1.
CoreBudget = Annotated[int, Field(ge=1)] | None

__all__ = [
    "CoreBudget",
    "JobArgument",
    "JobParameter",
    "JOB_FILE_PATTERN",
    "TrialsOverride",
    "WORKLOAD_PATTERN",
]
