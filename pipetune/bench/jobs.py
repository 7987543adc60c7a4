"""Bench jobs: a job file with one extra top-level section, ``bench``.

The section is removed before the job is validated::

    bench:
      datasets: ../../../shared/datasets   # data root, relative to this file
      fallback: {dataset: digits, train_samples: 1200, val_samples: 400}
      quick: {trials: 4, max_epochs: 3, workload_params: {train_samples: 600}}
      optuna_target: 1.05                  # pipetune-cold / optuna-plain tuning time

Relative ``workload.params.data_dir`` / ``path`` values are resolved against the data
root: ``$PIPETUNE_DATASETS`` when set, else ``bench.datasets`` relative to the job
file. When that path does not exist, ``bench.fallback`` replaces the workload's data
params (``dataset``, ``data_dir``, ``path`` and whatever it names), so the bench runs
on the workload's embedded data instead; the report says which data it used.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetune.errors import SpecError
from pipetune.modules import make_job_importable
from pipetune.spec import JobSpec, read_job_file
from pipetune.system.config import MachineInfo

_DATA_KEYS = ("dataset", "data_dir", "path")
_BENCH_KEYS = ("datasets", "fallback", "quick", "optuna_target")
#: Default target for pipetune-cold's tuning time as a multiple of optuna-plain's.
OPTUNA_TARGET = 1.05
_QUICK_KEYS = ("trials", "max_epochs", "workload_params")


@dataclass(frozen=True)
class BenchJob:
    """A bench job: the PipeTune job spec plus where its data came from."""

    spec: JobSpec
    path: str
    data: str
    quick: bool
    #: pipetune-cold's tuning time must be at most this multiple of optuna-plain's.
    optuna_target: float = OPTUNA_TARGET


def load_bench_job(
    path: str | Path,
    *,
    quick: bool = False,
    machine: MachineInfo | None = None,
    datasets: str | Path | None = None,
) -> BenchJob:
    """Read a bench job file (a job file with an optional ``bench`` section; see the
    module doc). ``datasets`` overrides the data root (default ``$PIPETUNE_DATASETS``,
    then ``bench.datasets``)."""
    path = Path(path)
    data = read_job_file(path)
    make_job_importable(path, data)  # a workload module beside the job file
    bench = data.pop("bench", None) or {}
    if not isinstance(bench, dict):
        raise SpecError("bench", "must be a mapping with datasets, fallback, quick")
    for key in bench:
        if key not in _BENCH_KEYS:
            raise SpecError(f"bench.{key}", f"unknown field; allowed: {', '.join(_BENCH_KEYS)}")
    root = datasets or os.environ.get("PIPETUNE_DATASETS") or bench.get("datasets")
    root_path = (path.parent / str(root)).resolve() if root is not None else None
    workload = dict(data.get("workload") or {})
    params = dict(workload.get("params") or {})
    params, note = resolve_data_params(params, root_path, bench.get("fallback"))
    workload["params"] = params
    data["workload"] = workload
    if quick:
        data = quick_overrides(data, bench.get("quick"))
    spec = JobSpec.from_dict(data, machine=machine)
    target = bench.get("optuna_target", OPTUNA_TARGET)
    if isinstance(target, bool) or not isinstance(target, int | float) or target <= 0:
        raise SpecError("bench.optuna_target", f"must be a number > 0, got {target!r}")
    return BenchJob(spec=spec, path=str(path), data=note, quick=quick,
                    optuna_target=float(target))


def resolve_data_params(
    params: Mapping[str, Any], root: Path | None, fallback: Mapping[str, Any] | None
) -> tuple[dict[str, Any], str]:
    """Workload params with relative data paths made absolute under ``root``; when a
    named path is missing, ``fallback`` replaces the data params. Returns the params
    and a note saying which data is used."""
    out = dict(params)
    named = {k: out[k] for k in ("data_dir", "path") if out.get(k) is not None}
    if not named:
        return out, f"{out.get('dataset', 'the workload default')} (embedded)"
    missing = []
    for key, value in named.items():
        p = Path(str(value)).expanduser()
        if not p.is_absolute():
            p = (root / p) if root is not None else p.resolve()
        out[key] = str(p)
        if not p.exists():
            missing.append(str(p))
    if not missing:
        return out, f"{out.get('dataset')} from {', '.join(out[k] for k in named)}"
    if fallback is None:
        raise SpecError(
            f"workload.params.{next(iter(named))}",
            f"{missing[0]} does not exist and the job has no bench.fallback",
        )
    if not isinstance(fallback, Mapping):
        raise SpecError("bench.fallback", "must be a mapping of workload params")
    out = {k: v for k, v in out.items() if k not in _DATA_KEYS}
    out.update(fallback)
    label = fallback.get("dataset", "the workload default")
    return out, f"{label} (embedded fallback: {missing[0]} not found)"


def quick_overrides(data: Mapping[str, Any], quick: Mapping[str, Any] | None) -> dict[str, Any]:
    """The job data with ``bench.quick`` applied: ``trials``, ``max_epochs`` and
    ``workload_params`` (merged over the job's). Without a ``quick`` section the
    trial budget is halved (at least 2)."""
    out = json.loads(json.dumps(data))
    quick = dict(quick or {})
    for key in quick:
        if key not in _QUICK_KEYS:
            raise SpecError(f"bench.quick.{key}",
                            f"unknown field; allowed: {', '.join(_QUICK_KEYS)}")
    search = out.setdefault("search", {})
    search["trials"] = quick.get("trials", max(2, int(search.get("trials", 2)) // 2))
    if "max_epochs" in quick:
        stopping = out.setdefault("early_stopping", {})
        stopping["max_epochs"] = quick["max_epochs"]
        stopping["min_epochs"] = min(int(stopping.get("min_epochs", 1)), quick["max_epochs"])
    if quick.get("workload_params"):
        out["workload"]["params"] = {**out["workload"].get("params", {}),
                                     **quick["workload_params"]}
    return out
