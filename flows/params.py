"""The study flow's parameter types, so Prefect can check them at run creation.

A deployment created with ``enforce_parameter_schema: true`` stores the JSON schema of
the flow's signature; the Prefect server checks every new flow run's parameters
against it and refuses the run (HTTP 409, nothing scheduled, nothing recorded) when
they do not fit.

The ``job`` parameter's schema is not written here: it is
:class:`pipetune.spec.JobSpec`'s own JSON schema (each section, distribution and
system knob carries the schema of its rules), so the deployment checks exactly the
fields, types, bounds and defaults a job file has, and cannot drift from them. The
flow still builds a :class:`~pipetune.spec.JobSpec` from the value (cross-field
rules, the machine, the workload's own parameters), so a value that passes here can
still be refused there, before anything is recorded. Only the flow's own parameters
are typed here.

>>> from pydantic import TypeAdapter
>>> TypeAdapter(JobArgument).validate_python("examples/lenet_digits.yaml")
'examples/lenet_digits.yaml'
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, InstanceOf
from pydantic.json_schema import SkipJsonSchema

from pipetune.spec import JobSpec


class _JobSpecSchema:
    """A plain dict whose JSON schema is :class:`JobSpec`'s, written into the flow's
    parameter schema with its definitions (the flow validates the value itself)."""

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict[str, Any]:
        return handler(JobSpec.__pydantic_core_schema__)


#: A job file: a path ending in ``.yaml`` or ``.yml``, read by the flow run from its
#: working directory (a deployment's is the folder it was deployed from).
JOB_FILE_PATTERN = r"^\S(?:.*\S)?\.ya?ml$"

#: The ``job`` parameter: an inline job (a plain dict, checked by the server against
#: the job spec's JSON schema) or the path of a job file. A caller in this process that
#: has already checked its job (``pipetune tune``) passes the :class:`JobSpec` itself,
#: so the job is validated once per command; that form is not offered to deployments.
JobArgument = (
    SkipJsonSchema[InstanceOf[JobSpec]]
    | Annotated[dict[str, Any], _JobSpecSchema()]
    | Annotated[str, Field(pattern=JOB_FILE_PATTERN)]
)

#: ``trials``: overrides ``search.trials``; at least 1.
TrialsOverride = Annotated[int, Field(ge=1)] | None

#: ``core_budget``: cores the executor offers at once; at least 1.
CoreBudget = Annotated[int, Field(ge=1)] | None

__all__ = ["CoreBudget", "JOB_FILE_PATTERN", "JobArgument", "TrialsOverride"]
