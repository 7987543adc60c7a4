"""The Python API, for scripts and notebooks: :func:`tune` runs a study as
``pipetune tune`` does and returns a :class:`TuneResult`.

::

    import pipetune

    result = pipetune.tune("job.yaml", trials=8)
    result.best_params, result.best_system
    result.trials_dataframe()          # pandas, one row per trial
    model = result.load_best_model()   # the best trial's model, from its checkpoint

The same Prefect flow (one flow run per study, its task runs), the same embedded
default (a local Prefect server and Dask cluster, kept warm between calls, and the
MLflow store ``./mlflow.db``) and the same records as the command line. A job's error
is the command's one line, raised as a :class:`~pipetune.errors.PipetuneError`
(:class:`~pipetune.errors.SpecError` for a bad field, named by the field or keyword).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipetune.api.result import TuneResult
from pipetune.errors import PipetuneError, SpecError


def tune(job: str | Path | Mapping[str, Any] | Any, *, workload: Any = None,
         trials: int | None = None, tracking_uri: str | None = None,
         checkpoints: str | None = None, dask_address: str | None = None,
         pipetune: bool = True, resume: str | None = None, workers: int | None = None,
         cores_per_worker: int | None = None, keep_warm: float | None = None,
         keep_checkpoints: str = "best-and-last", progress: bool | None = None) -> TuneResult:
    """Tune ``job`` and return what the study found.

    ``job``: a job file's path, the same document as a dict, or a
    :class:`~pipetune.spec.JobSpec`. ``workload``: a
    :class:`~pipetune.workloads.Workload` subclass (or ``torch_workload(...)``'s result)
    that the job's ``workload.name`` then names; one defined in a notebook or inside a
    function is sent to the workers by value. The other keywords are the command
    line's options (``trials`` overrides ``search.trials``; ``pipetune=False`` is
    ``--no-pipetune``; ``resume="latest"`` or a study id resumes a stopped study).
    ``progress``: draw the study's progress (a bar in a notebook, the live table in a
    terminal); default: where there is one to draw on."""
    _not_in_a_worker()
    spec = job_spec(job, workload)
    if trials is not None and (isinstance(trials, bool) or not isinstance(trials, int)
                               or trials < 1):
        raise SpecError("trials", f"must be an integer >= 1, got {trials!r}")
    if keep_checkpoints not in ("best-and-last", "all"):
        raise SpecError("keep_checkpoints", "must be 'best-and-last' or 'all', got "
                        f"{keep_checkpoints!r}")
    args = argparse.Namespace(
        job=spec, trials=trials, tracking_uri=tracking_uri, checkpoints=checkpoints,
        dask_address=dask_address, allow_insecure_dask=None, no_pipetune=not pipetune,
        resume=resume, workers=workers, cores_per_worker=cores_per_worker,
        keep_warm=keep_warm, keep_checkpoints=keep_checkpoints)
    from pipetune.api.progress import display_for, quiet_tqdm_advice

    quiet_tqdm_advice()
    from pipetune.cli.tune import tune_study
    from pipetune.dask.cluster import ClusterStartError

    try:
        tuned = tune_study(args, display=display_for(progress))
    except SpecError as e:  # the command line's option names, as this function's keywords
        if e.field.startswith("--"):
            raise SpecError(e.field[2:].replace("-", "_"), e.message) from None
        raise
    except ClusterStartError as e:
        said = str(e).replace("pass --dask-address", "pass dask_address=")
        if getattr(sys.modules.get("__main__"), "__file__", None):
            said = f"{said}; {_GUARD}"
        raise ClusterStartError(said) from None
    return TuneResult(tuned.summary, tuned.study, flow_run_id=tuned.flow_run_id,
                      prefect_ui=tuned.prefect_ui)


#: What a script that calls :func:`tune` must do.
_GUARD = ("a script must call pipetune.tune() under `if __name__ == \"__main__\":` (the "
          "embedded cluster's worker processes import the script, as Python's "
          "multiprocessing does)")


def _not_in_a_worker() -> None:
    """Refuse a call made while a worker process imports the caller's script."""
    main = sys.modules.get("__main__")
    if getattr(main, "__name__", "__main__") == "__mp_main__":
        raise PipetuneError(f"pipetune.tune() was called in a worker process importing "
                            f"the script: {_GUARD}")


def job_spec(job: Any, workload: Any = None) -> Any:
    """``job`` (a path, a dict or a :class:`~pipetune.spec.JobSpec`) as a checked
    ``JobSpec``, its workload replaced by ``workload`` where one is given."""
    from pipetune.spec import JobSpec, load_spec

    if isinstance(job, JobSpec):
        if workload is None:
            return job
        data = job.to_dict()
    elif isinstance(job, (str, Path)):
        if workload is None:
            return load_spec(job)
        from pipetune.spec import read_job_file

        data = read_job_file(job)
    elif isinstance(job, Mapping):
        data = dict(job)
    else:
        raise SpecError("job", "must be a job file's path, a dict of the job, or a JobSpec, "
                        f"got {type(job).__name__}")
    if workload is not None:
        data["workload"] = _with_workload(data.get("workload"), workload)
    from pipetune.modules import make_job_importable

    make_job_importable(Path(job) if isinstance(job, (str, Path)) else Path.cwd() / "job",
                        data)
    return JobSpec.from_dict(data)


def _with_workload(section: Any, workload: Any) -> dict[str, Any]:
    """The job's ``workload`` section naming ``workload`` (a class, or an instance whose
    ``params`` join the section's)."""
    from pipetune.workloads import Workload
    from pipetune.workloads.shipped import workload_name

    section = dict(section) if isinstance(section, Mapping) else {}
    params = dict(section.get("params") or {})
    if isinstance(workload, Workload):
        params.update(workload.params)
        workload = type(workload)
    section["name"] = workload_name(workload)
    if params:
        section["params"] = params
    return section


__all__ = ["TuneResult", "job_spec", "tune"]
