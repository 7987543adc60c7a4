"""What :func:`pipetune.tune` returns: the study's best trial, its trials and epochs as
pandas tables, where its records are, and the best model rebuilt from its checkpoint."""

from __future__ import annotations

import math
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

    from pipetune.engine.study import Study
    from pipetune.system.config import SystemConfig
    from pipetune.workloads import Workload


class TuneResult:
    """A finished study (:func:`pipetune.tune`'s answer)."""

    def __init__(self, summary: dict[str, Any], study: Study, *,
                 flow_run_id: str | None = None, prefect_ui: str = "") -> None:
        #: The study's summary, as the command line prints it (JSON-able).
        self.summary = summary
        self.study = study
        #: Its Prefect flow run, where Prefect recorded it.
        self.flow_run_id = flow_run_id
        #: The Prefect UI still serving it ("": the study's own server stopped with it).
        self.prefect_ui = prefect_ui
        self.study_id: str = summary["study_id"]
        self.metric: str = study.metric
        self.mode: str = study.mode
        #: The MLflow store, the study's experiment and its parent run.
        self.tracking_uri: str = summary["tracking_uri"]
        self.experiment_id: str = summary.get("experiment_id") or ""
        self.run_id: str = summary["parent_run_id"]

    # -- the best trial -----------------------------------------------------------------
    @property
    def best_trial(self) -> int | None:
        best = self.study.best_trial()
        return None if best is None else best.trial_id

    @property
    def best_value(self) -> float | None:
        best = self.study.best_trial()
        return None if best is None else best.last_value(self.metric)

    @property
    def best_params(self) -> dict[str, Any]:
        """The best trial's hyperparameters (``system.*`` entries of a joint space too)."""
        best = self.study.best_trial()
        return {} if best is None else dict(best.params)

    @property
    def best_system(self) -> SystemConfig | None:
        """The system config the best trial ended under."""
        best = self.study.best_trial()
        return None if best is None else best.final_system

    # -- tables ---------------------------------------------------------------------------
    def trials_dataframe(self) -> pd.DataFrame:
        """One row per trial: its outcome, epochs, final metric, hyperparameters
        (``params.<name>``), final system config (``system.<knob>`` and ``system``, its
        label), times, and its MLflow run (``run_id``)."""
        import pandas as pd

        runs = self.trial_run_ids()
        rows = []
        for t in sorted(self.study.trials.values(), key=lambda t: t.trial_id):
            started = t.started if t.started is not None else math.nan
            ended = t.ended if t.ended is not None else started
            rows.append({
                "trial": t.trial_id, "state": str(t.state), "value": t.last_value(self.metric),
                "epochs": t.epochs_run, "probe_epochs": t.probe_epochs,
                **{f"params.{k}": v for k, v in sorted(t.params.items())},
                "system": t.final_system.label() if t.final_system else "",
                **_knobs(t.final_system),
                "groundtruth": ("hit" if t.match.hit else "miss") if t.match else "",
                "started": pd.to_datetime(started, unit="s", utc=True),
                "duration_s": ended - started,
                "epochs_s": sum(r.measurement.wall_s for r in t.results),
                "energy_j": sum(r.measurement.energy_j for r in t.results),
                "error": t.error or "", "run_id": runs.get(t.trial_id, ""),
            })
        return pd.DataFrame(rows)

    def epochs_dataframe(self) -> pd.DataFrame:
        """One row per epoch run: its trial, number, phase (profile, probe, train), the
        system config it ran under, its metrics, its seconds (the epoch's own, the
        worker's around it) and energy, where it ran and its checkpoint."""
        import pandas as pd

        rows = []
        for t in sorted(self.study.trials.values(), key=lambda t: t.trial_id):
            for r in t.results:
                m = r.measurement
                rows.append({
                    "trial": t.trial_id, "epoch": r.epoch, "phase": r.phase.value,
                    "system": r.system.label(), **_knobs(r.system),
                    "train_loss": r.train_loss,
                    **{f"metrics.{k}": v for k, v in sorted(r.metrics.items())},
                    "wall_s": m.wall_s, "cpu_s": m.cpu_s, "energy_j": m.energy_j,
                    "one_time_s": m.one_time_s, "setup_s": r.setup_s, "eval_s": r.eval_s,
                    "started": pd.to_datetime(r.started, unit="s", utc=True),
                    "finished": pd.to_datetime(r.finished, unit="s", utc=True),
                    "worker": r.worker, "checkpoint": r.checkpoint,
                })
        return pd.DataFrame(rows)

    # -- records ---------------------------------------------------------------------------
    def trial_run_ids(self) -> dict[int, str]:
        """Trial id -> its MLflow run id (read from the store once)."""
        return dict(self._trial_runs)

    @cached_property
    def _trial_runs(self) -> dict[int, str]:
        from mlflow.tracking import MlflowClient

        if not self.experiment_id or not self.run_id:
            return {}
        runs = MlflowClient(self.tracking_uri).search_runs(
            [self.experiment_id], f"tags.mlflow.parentRunId = '{self.run_id}'",
            max_results=50_000)
        return {int(r.data.tags["pipetune.trial_id"]): r.info.run_id for r in runs
                if "pipetune.trial_id" in r.data.tags}

    @property
    def links(self) -> dict[str, str]:
        """Where to look: ``mlflow`` (the study's runs in the MLflow UI, served by
        ``pipetune ui`` for a local store), ``mlflow_run`` (its parent run) and, where a
        Prefect server still serves it (the warm local service's, or yours),
        ``prefect`` (its flow run)."""
        from pipetune.tracking.links import run_url, study_runs_url, ui_base_url

        base = ui_base_url(self.tracking_uri)
        links = {"mlflow": study_runs_url(base, self.experiment_id, self.study_id),
                 "mlflow_run": run_url(base, self.run_id, self.experiment_id)}
        if self.flow_run_id and self.prefect_ui:
            links["prefect"] = f"{self.prefect_ui}/runs/flow-run/{self.flow_run_id}"
        return links

    # -- the best model --------------------------------------------------------------------
    def load_best_workload(self) -> Workload:
        """The best trial's workload, built here with its hyperparameters and seed and
        loaded from its last checkpoint (``evaluate``, ``predict``, ``model``)."""
        from pipetune.checkpoints import CheckpointStore
        from pipetune.errors import PipetuneError
        from pipetune.workloads import resolve_workload

        best = self.study.best_trial()
        if best is None or not best.checkpoint:
            raise PipetuneError(f"study {self.study_id}: no trial finished an epoch with a "
                                "checkpoint; there is no best model")
        task = self.study.final_task(best)
        workload = resolve_workload(task.workload)(**task.workload_params)
        workload.setup(task.hparams, task.seed)
        CheckpointStore.load(workload, best.checkpoint)
        return workload

    def load_best_model(self) -> Any:
        """The best trial's model (a ``torch.nn.Module`` for the built-in, classifier
        and function workloads: their ``trained_model()``; else the workload's ``model``
        attribute, else the workload), its weights from the trial's last checkpoint."""
        workload = self.load_best_workload()
        if hasattr(workload, "trained_model"):  # TorchClassifierWorkload and its kind
            return workload.trained_model()
        model = getattr(workload, "model", None)
        return model if model is not None else workload

    def __repr__(self) -> str:
        best = (f"best {self.metric}={self.best_value:.4g} (trial {self.best_trial}) "
                f"params={self.best_params} system={self.best_system.label()}"
                if self.best_value is not None and self.best_system is not None
                else "no trial finished")
        return (f"TuneResult(study {self.study_id}: {len(self.study.trials)} trials, "
                f"{best})")


def _knobs(system: SystemConfig | None) -> dict[str, Any]:
    return {} if system is None else {f"system.{k}": v for k, v in system.to_dict().items()}
