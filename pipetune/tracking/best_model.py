"""What a study's ``best_model/`` artifacts say: enough to rebuild the best trial's model
in a fresh process and get back the metric it was recorded with.

``best_model.json`` holds the seed, the hyperparameters exactly as the workload's
``setup`` got them (``system.<knob>`` entries of a joint-tuning space split off), the
system config, the workload's name, import path and params, the metric and its value,
the torch version the epoch ran under, and ``load_recipe``: a runnable snippet, also
logged as ``load_best_model.py``, that loads ``best_model.pt`` from the folder it runs
in, evaluates it and prints the metric beside the recorded value.
"""

from __future__ import annotations

import json
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipetune.engine.study import Study, Trial
    from pipetune.runner import EpochTask

#: What the recipe loads; it runs in the folder ``best_model/`` was downloaded to.
CHECKPOINT_FILE = "best_model.pt"


def _plain(value: Any) -> Any:
    """``value`` as plain JSON types (numpy scalars from a searcher become numbers), so
    its ``repr`` is a Python literal."""
    def scalar(v: Any) -> Any:
        return v.item() if hasattr(v, "item") else str(v)

    return json.loads(json.dumps(value, default=scalar))


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def import_path(workload: str) -> str:
    """``package.module:Class`` of a workload as a job names it (a built-in's own path)."""
    from pipetune.workloads import BUILTIN_WORKLOADS

    return BUILTIN_WORKLOADS.get(workload, workload)


def load_recipe(task: EpochTask, metric: str, value: float | None) -> str:
    """A runnable snippet that rebuilds ``task``'s model from ``best_model.pt`` and
    evaluates it under ``task.system`` with the torch threads the metric was measured
    with (and deterministic algorithms when the job asked for them)."""
    knobs = ", ".join(f"{k}={v!r}" for k, v in task.system.to_dict().items())
    lines = [
        "# Rebuild the study's best model and evaluate it (run beside best_model.pt).",
        "import torch",
        "",
        "from pipetune.system.config import SystemConfig",
        "from pipetune.workloads import resolve_workload",
        "",
        f"torch.set_num_threads({task.system.cores})",
    ]
    if task.deterministic:
        lines.append("torch.use_deterministic_algorithms(True)")
    module = import_path(task.workload).partition(":")[0]
    if not module.startswith("pipetune."):
        lines.append(f"# {module} must be importable here (on PYTHONPATH), as on the workers")
    lines += [
        f"w = resolve_workload({task.workload!r})(**{_plain(task.workload_params)!r})",
        f"w.setup({_plain(task.hparams)!r}, {task.seed!r})",
        f"w.load({CHECKPOINT_FILE!r})",
        f"metrics = w.evaluate(SystemConfig({knobs}))",
        f"print({metric!r}, repr(metrics[{metric!r}]), 'recorded', {value!r})",
    ]
    return "\n".join(lines) + "\n"


def best_model_record(study: Study, trial: Trial) -> dict[str, Any]:
    """The contents of ``best_model.json`` for ``trial``, the study's best."""
    task = study.final_task(trial)  # what rebuilds the trial's last model, as its epochs did
    last = trial.results[-1]
    metric = study.metric
    value = last.metrics.get(metric)
    return {
        "trial_id": trial.trial_id,
        "epoch": last.epoch,
        "seed": task.seed,
        "hyperparameters": _plain(task.hparams),
        "params": _plain(trial.params),
        "workload": task.workload,
        "workload_import_path": import_path(task.workload),
        "workload_params": _plain(task.workload_params),
        "metric": metric,
        "value": value,
        "metrics": dict(last.metrics),
        "system": trial.final_system.to_dict() if trial.final_system else None,
        "evaluated_under": task.system.to_dict(),
        "deterministic": task.deterministic,
        "torch_version": last.torch_version or _version("torch"),
        "pipetune_version": _version("pipetune"),
        "checkpoint": trial.checkpoint,
        "load_recipe": load_recipe(task, metric, value),
        # The earlier release's key, kept for readers of it (deprecated: load_recipe).
        "load_with": "Workload.setup(params, seed), then Workload.load(path); "
                     "deprecated: run load_recipe",
    }
