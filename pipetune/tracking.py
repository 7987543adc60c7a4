"""MLflow record of a study: one parent run, one child run per trial.

Only the process that owns the study loop writes here; workers return results. The
tracking store and the experiment are created once, before any fan-out (several
processes creating one fresh SQLite store at once fail).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipetune.runner import EpochResult
    from pipetune.spec import JobSpec
    from pipetune.study import Study, Trial

#: Experiment every study is filed under unless the caller names another.
DEFAULT_EXPERIMENT = "pipetune"


def default_tracking_uri(cwd: str | Path | None = None) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else a SQLite file ``mlflow.db`` in the working folder."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    folder = Path(cwd or os.getcwd()).resolve()
    return f"sqlite:///{folder / 'mlflow.db'}"


def _artifact_root(tracking_uri: str) -> str | None:
    """Artifacts of a SQLite store go beside the database file, not into the cwd."""
    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri[len("sqlite:///"):])
        return (db.parent / "mlartifacts").resolve().as_uri()
    return None


def ensure_experiment(tracking_uri: str, name: str = DEFAULT_EXPERIMENT) -> str:
    """Create the store and the experiment if needed; return the experiment id."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    return client.create_experiment(name, artifact_location=_artifact_root(tracking_uri))


def _metric(key: str, value: float, step: int, timestamp_ms: int):
    from mlflow.entities import Metric

    return Metric(key=key, value=float(value), timestamp=timestamp_ms, step=step)


class StudyTracker:
    """Writes a study to MLflow as it runs.

    Per-epoch metrics are logged with ``step = epoch``; every system knob is logged as
    a metric too so the UI can plot the config against the epoch.
    """

    def __init__(
        self,
        tracking_uri: str,
        spec: JobSpec,
        *,
        experiment: str = DEFAULT_EXPERIMENT,
        tags: dict[str, str] | None = None,
        run_name: str | None = None,
    ):
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri)
        self.experiment_id = ensure_experiment(tracking_uri, experiment)
        self.spec = spec
        self.tags = dict(tags or {})
        self.started = time.time()
        parent = self.client.create_run(
            self.experiment_id,
            run_name=run_name or spec.name,
            tags={**self.tags, "pipetune.kind": "study", "pipetune.job": spec.name},
        )
        self.parent_run_id: str = parent.info.run_id
        self._children: dict[int, str] = {}
        spec_dict = spec.to_dict()
        from mlflow.entities import Param

        params = [
            Param("job", spec.name),
            Param("workload", spec.workload.name),
            Param("search.algorithm", spec.search.algorithm),
            Param("search.trials", str(spec.search.trials)),
            Param("search.max_concurrent", str(spec.search.max_concurrent)),
            Param("early_stopping", spec.early_stopping.policy),
            Param("max_epochs", str(spec.early_stopping.max_epochs)),
            Param("objective.metric", f"{spec.objective.metric} ({spec.objective.mode})"),
            Param("objective.system", spec.objective.system),
            Param("pipetune.enabled", str(spec.pipetune.enabled)),
            Param("system.default", spec.system.default.label()),
        ]
        self.client.log_batch(self.parent_run_id, params=params)
        self.client.log_dict(self.parent_run_id, spec_dict, "job.json")
        self.client.log_dict(
            self.parent_run_id,
            {"hyperparameters": spec_dict["hyperparameters"], "system": spec_dict["system"]},
            "spaces.json",
        )

    # -- trials -----------------------------------------------------------------------
    def _child(self, trial: Trial) -> str:
        run_id = self._children.get(trial.trial_id)
        if run_id is None:
            from mlflow.entities import Param

            run = self.client.create_run(
                self.experiment_id,
                run_name=f"trial-{trial.trial_id}",
                tags={
                    **self.tags,
                    "mlflow.parentRunId": self.parent_run_id,
                    "pipetune.kind": "trial",
                    "pipetune.trial_id": str(trial.trial_id),
                },
            )
            run_id = run.info.run_id
            self._children[trial.trial_id] = run_id
            params = [Param(k, json.dumps(v) if not isinstance(v, str) else v)
                      for k, v in sorted(trial.params.items())]
            params.append(Param("seed", str(trial.seed)))
            self.client.log_batch(run_id, params=params)
        return run_id

    def child_run_id(self, trial_id: int) -> str | None:
        return self._children.get(trial_id)

    def log_epoch(self, trial: Trial, result: EpochResult) -> None:
        """Metrics of one finished epoch, at ``step = epoch``, in one batch call."""
        from mlflow.entities import RunTag

        run_id = self._child(trial)
        ts = int(result.finished * 1000)
        m = result.measurement
        values: dict[str, float] = {
            "train_loss": result.train_loss,
            "epoch_seconds": m.wall_s,
            "samples_per_s": m.samples_per_s,
            "energy_j": m.energy_j,
            "cpu_util": m.cpu_util,
            "cost_per_sample": result.cost(self.spec.objective.system),
            "profiler_overhead_s": m.overhead_s,
            **{k: v for k, v in result.metrics.items()},
            **result.system.as_metrics(),
        }
        metrics = [_metric(k, v, result.epoch, ts) for k, v in values.items()]
        tags = [
            RunTag(f"epoch.{result.epoch:03d}.phase", result.phase.value),
            RunTag(f"epoch.{result.epoch:03d}.system", result.system.label()),
            RunTag("energy_source", m.energy_source),
            RunTag("counters_source", m.counters_source),
        ]
        self.client.log_batch(run_id, metrics=metrics, tags=tags)

    def end_trial(self, trial: Trial, *, metric: str, objective: str) -> None:
        """Outcome, profile table and the config the trial settled on."""
        from mlflow.entities import RunTag

        run_id = self._child(trial)
        tags = [RunTag("outcome", trial.state)]
        if trial.error:
            tags.append(RunTag("error", trial.error[:5000]))
        if trial.match is not None:
            tags.append(RunTag("groundtruth", "hit" if trial.match.hit else "miss"))
            tags.append(RunTag("groundtruth.reason", trial.match.reason[:5000]))
        if trial.final_system is not None:
            tags.append(RunTag("system.final", trial.final_system.label()))
        now = int(time.time() * 1000)
        metrics = [_metric("probe_epochs", trial.probe_epochs, 0, now)]
        value = trial.last_value(metric)
        if value is not None:
            metrics.append(_metric(f"final_{metric}", value, trial.epochs_run, now))
        self.client.log_batch(run_id, metrics=metrics, tags=tags)
        if trial.results:
            self.client.log_text(run_id, profiles_csv(trial), "profiles.csv")
        status = "FAILED" if trial.state == "failed" else "FINISHED"
        self.client.set_terminated(run_id, status=status)

    # -- the study ----------------------------------------------------------------------
    def finish(self, study: Study, *, wall_s: float, extra_metrics: dict[str, float] | None = None,
               failed: bool = False) -> None:
        """Summary metrics, trials table, timeline picture and best model on the parent run."""
        from mlflow.entities import Param, RunTag

        from pipetune.reports import timeline_figure, trials_table

        summary = study.summary()
        metrics = {**summary.to_metrics(), "tuning_wall_s": wall_s, **(extra_metrics or {})}
        ts = int(time.time() * 1000)
        tags = [RunTag("energy_source", summary.energy_source)]
        params = []
        if summary.best_params is not None:
            params.append(Param("best_params", json.dumps(summary.best_params, sort_keys=True)))
        if summary.best_system is not None:
            params.append(Param("best_system", summary.best_system.label()))
        if summary.best_trial is not None and summary.best_trial in self._children:
            tags.append(RunTag("best_trial_run_id", self._children[summary.best_trial]))
        self.client.log_batch(
            self.parent_run_id,
            metrics=[_metric(k, v, 0, ts) for k, v in metrics.items()],
            params=params,
            tags=tags,
        )
        table = trials_table(study)
        self.client.log_text(self.parent_run_id, table.to_csv(index=False), "trials.csv")
        fig = timeline_figure(study)
        self.client.log_figure(self.parent_run_id, fig, "timeline.png")
        import matplotlib.pyplot as plt

        plt.close(fig)
        best = study.best_trial()
        if best is not None and best.checkpoint is not None:
            self._log_best_model(best)
        self.client.set_terminated(self.parent_run_id, status="FAILED" if failed else "FINISHED")

    def _log_best_model(self, trial: Trial) -> None:
        import fsspec

        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "best_model.pt"
            with fsspec.open(trial.checkpoint, "rb") as src:
                local.write_bytes(src.read())
            meta = Path(tmp) / "best_model.json"
            meta.write_text(json.dumps({
                "trial_id": trial.trial_id,
                "params": trial.params,
                "workload": self.spec.workload.name,
                "workload_params": self.spec.workload.params,
                "system": trial.final_system.to_dict() if trial.final_system else None,
                "checkpoint": trial.checkpoint,
                "load_with": "Workload.setup(params, seed), then Workload.load(path)",
            }, indent=2, default=str))
            self.client.log_artifact(self.parent_run_id, str(local), "best_model")
            self.client.log_artifact(self.parent_run_id, str(meta), "best_model")

    def fail(self) -> None:
        for run_id in self._children.values():
            run = self.client.get_run(run_id)
            if run.info.status == "RUNNING":
                self.client.set_terminated(run_id, status="KILLED")
        self.client.set_terminated(self.parent_run_id, status="FAILED")


def profiles_csv(trial: Trial) -> str:
    """One row per epoch: phase, system config and every profile feature."""
    import pandas as pd

    rows: list[dict[str, Any]] = []
    for r in trial.results:
        m = r.measurement
        rows.append({
            "epoch": r.epoch,
            "phase": r.phase.value,
            "system": r.system.label(),
            "wall_s": m.wall_s,
            "samples_per_s": m.samples_per_s,
            "energy_j": m.energy_j,
            "energy_source": m.energy_source,
            "counters_source": m.counters_source,
            **m.profile.features,
        })
        if r.phase.value != "profile":  # the operator mix is sampled in the profiled epoch only
            rows[-1].update({k: None for k in m.profile.features if k.startswith("op_")})
    return pd.DataFrame(rows).to_csv(index=False)
