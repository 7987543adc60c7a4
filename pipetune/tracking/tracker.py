"""The study's view of its MLflow record: :class:`StudyTracker` creates (or resumes) the
parent run, sends each epoch and trial outcome to an :class:`~pipetune.tracking.sink.MlflowSink`
and writes the study's summary, tables and best model at the end."""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipetune.states import TrialState
from pipetune.tracking import DEFAULT_EXPERIMENT, ensure_experiment, mlflow_client
from pipetune.tracking.sink import MlflowSink, as_metric

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from pipetune.runner import EpochResult
    from pipetune.spec import JobSpec
    from pipetune.study import Study, Trial

logger = logging.getLogger(__name__)


class StudyTracker:
    """Writes a study to MLflow as it runs.

    Per-epoch metrics are logged with ``step = epoch``; every system knob is logged as
    a metric too so the UI can plot the config against the epoch.

    The parent run is created and described at construction. Everything per trial
    (:meth:`log_epoch`, :meth:`end_trial`) is sent to an :class:`MlflowSink` and returns
    at once: the sink runs in this process's recorder process
    (:func:`pipetune.sidecar.shared_host`), off the study loop's GIL, or in a thread
    when ``client`` (an ``MlflowClient`` replacing the one built from ``tracking_uri``)
    is given. :meth:`flush` waits for what was sent and raises what a write raised.
    :meth:`finish` and :meth:`fail` flush first and stop the sink; :meth:`close` stops
    it alone.
    """

    def __init__(
        self,
        tracking_uri: str,
        spec: JobSpec,
        *,
        experiment: str = DEFAULT_EXPERIMENT,
        tags: dict[str, str] | None = None,
        run_name: str | None = None,
        client: MlflowClient | None = None,
        resume_run_id: str | None = None,
    ):

        from pipetune.sidecar import ThreadHost, shared_host

        self.tracking_uri = tracking_uri
        self.client = client if client is not None else mlflow_client(tracking_uri)
        self.experiment_id = ensure_experiment(tracking_uri, experiment)
        self.spec = spec
        self.tags = dict(tags or {})
        self.started = time.time()
        #: trial id -> child run id, as last heard from the sink.
        self._children: dict[int, str] = {}
        #: trial ids whose child run was sent for creation.
        self._requested: set[int] = set()
        if resume_run_id is not None:
            self._resume(resume_run_id)
        else:
            self._create(spec, run_name)
        where = {"experiment_id": self.experiment_id, "parent_run_id": self.parent_run_id,
                 "tags": self.tags, "children": dict(self._children)}
        self._thread_host: ThreadHost | None = None
        if client is not None:
            self._thread_host = ThreadHost("pipetune-mlflow-writer")
            self._sink = self._thread_host.attach(MlflowSink(client=client, **where), "mlflow")
        else:
            self._sink = shared_host().attach(
                "pipetune.tracking.sink:MlflowSink", "mlflow", tracking_uri=tracking_uri, **where)

    def _resume(self, run_id: str) -> None:
        """Continue the parent run ``run_id`` and its trial runs (a resumed study)."""
        self.parent_run_id = run_id
        self.experiment_id = self.client.get_run(run_id).info.experiment_id
        self.client.update_run(run_id, status="RUNNING")
        self._children = self._children_from_store()
        self._requested = set(self._children)

    def reopen_trials(self, trial_ids: list[int]) -> None:
        """Trial runs ended KILLED by the stop are running again (their trials go on)."""
        for trial_id in trial_ids:
            if trial_id in self._children:
                self.client.update_run(self._children[trial_id], status="RUNNING")

    def _create(self, spec: JobSpec, run_name: str | None) -> None:
        parent = self.client.create_run(
            self.experiment_id,
            run_name=run_name or spec.name,
            tags={**self.tags, "pipetune.kind": "study", "pipetune.job": spec.name},
        )
        self.parent_run_id: str = parent.info.run_id
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

    # -- the sink -----------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> None:
        """Wait until every write sent so far is in MLflow; raise the first exception a
        background write raised since the last flush (``SidecarError`` past ``timeout``)."""
        self._children = self._sink.call("children", timeout=timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flush and stop the sink (idempotent). Later per-trial calls raise."""
        if self._sink.closed:
            return
        try:
            self.flush(timeout)
        finally:
            self._sink.close(timeout)
            if self._thread_host is not None:
                self._thread_host.stop(timeout)

    @property
    def artifact_uri(self) -> str:
        """The study run's artifact location (``mlflow-artifacts:/...`` on a tracking
        server with ``--serve-artifacts``)."""
        return self.client.get_run(self.parent_run_id).info.artifact_uri

    # -- trials -----------------------------------------------------------------------
    def _child(self, trial: Trial) -> tuple[str, int]:
        """The sink's key of the trial's child run; the run is created (by the sink)
        the first time a trial is seen."""
        if trial.trial_id not in self._requested:
            params = [(k, json.dumps(v) if not isinstance(v, str) else v)
                      for k, v in sorted(trial.params.items())]
            params.append(("seed", str(trial.seed)))
            self._sink.send("create_child", trial.trial_id)
            self._requested.add(trial.trial_id)
            self._sink.send("log", ("trial", trial.trial_id), (), params, ())
        return ("trial", trial.trial_id)

    def log_epoch(self, trial: Trial, result: EpochResult) -> None:
        """Send the metrics of one finished epoch, at ``step = epoch``."""
        run = self._child(trial)
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
            "one_time_s": m.one_time_s,
            "steady_step_s": m.steady_step_s,
            **{k: v for k, v in result.metrics.items()},
            **result.system.as_metrics(),
        }
        metrics = [(k, float(v), result.epoch, ts) for k, v in values.items()]
        tags = [
            (f"epoch.{result.epoch:03d}.phase", result.phase.value),
            (f"epoch.{result.epoch:03d}.system", result.system.label()),
            ("energy_source", m.energy_source),
            ("counters_source", m.counters_source),
        ]
        if len(trial.decisions) >= result.epoch:  # why this epoch ran under its config
            reason = trial.decisions[result.epoch - 1].reason
            tags.append((f"epoch.{result.epoch:03d}.decision", reason[:5000]))
        self._sink.send("log", run, metrics, (), tags)

    def end_trial(self, trial: Trial, *, metric: str) -> None:
        """Send the outcome, profile table and the config the trial settled on, then the
        end of the trial's run."""
        run = self._child(trial)
        tags = [("outcome", str(trial.state))]
        if trial.error:
            tags.append(("error", trial.error[:5000]))
        if trial.match is not None:
            tags.append(("groundtruth", "hit" if trial.match.hit else "miss"))
            tags.append(("groundtruth.reason", trial.match.reason[:5000]))
        if trial.final_system is not None:
            tags.append(("system.final", trial.final_system.label()))
        now = int(time.time() * 1000)
        metrics = [("probe_epochs", float(trial.probe_epochs), 0, now)]
        value = trial.last_value(metric)
        if value is not None:
            metrics.append((f"final_{metric}", float(value), trial.epochs_run, now))
        self._sink.send("log", run, metrics, (), tags)
        if trial.results:
            self._sink.send("log_profiles", run, profile_rows(trial))
        status = "FAILED" if trial.state == TrialState.FAILED else "FINISHED"
        self._sink.send("terminate", run, status)

    # -- the study ----------------------------------------------------------------------
    def finish(self, study: Study, *, wall_s: float,
               extra_metrics: dict[str, float] | None = None) -> None:
        """Summary metrics, trials table, timeline picture and best model on the parent run.

        Flushes the background writer first (raising what it raised) and closes it last."""
        from mlflow.entities import Param, RunTag

        from pipetune.reports import timeline_figure, trials_table

        self.flush()
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
            metrics=[as_metric(k, v, 0, ts) for k, v in metrics.items()],
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
            self._log_best_model(study, best)
        self.client.set_terminated(self.parent_run_id, status="FINISHED")
        self.close()

    def _log_best_model(self, study: Study, trial: Trial) -> None:
        """``best_model/``: the checkpoint, ``best_model.json`` (what it is and how it
        was made, see :mod:`pipetune.tracking.best_model`) and ``load_best_model.py``."""
        from pipetune.checkpoints import CheckpointStore
        from pipetune.tracking.best_model import CHECKPOINT_FILE, best_model_record

        record = best_model_record(study, trial)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            (folder / CHECKPOINT_FILE).write_bytes(CheckpointStore.read_bytes(trial.checkpoint))
            (folder / "best_model.json").write_text(json.dumps(record, indent=2, default=str))
            (folder / "load_best_model.py").write_text(record["load_recipe"])
            self.client.log_artifacts(self.parent_run_id, tmp, "best_model")

    def fail(self, *, timeout: float | None = 120.0, status: str = "FAILED") -> None:
        """End the study as failed: still-running child runs KILLED, the parent
        ``status`` (``FAILED``, or ``KILLED`` when the study was stopped).

        Writes everything sent first (waiting at most ``timeout`` seconds), so what was
        recorded before the failure is kept. Never raises: what cannot be written (a
        background write that failed, a store that is down) is logged."""
        try:
            self.close(timeout)
        except Exception:  # noqa: BLE001 - failing already; say what was lost
            logger.warning("MLflow: some writes of study run %s were lost",
                           self.parent_run_id, exc_info=True)
        children = dict(self._children)
        if len(children) < len(self._requested):  # the sink's map was lost with a write
            children.update(self._children_from_store())
        for trial_id, run_id in sorted(children.items()):
            try:
                run = self.client.get_run(run_id)
                if run.info.status == "RUNNING":
                    self.client.set_terminated(run_id, status="KILLED")
            except Exception:  # noqa: BLE001
                logger.warning("MLflow: could not end the run of trial %s", trial_id,
                               exc_info=True)
        try:
            self.client.set_terminated(self.parent_run_id, status=status)
        except Exception:  # noqa: BLE001
            logger.warning("MLflow: could not mark study run %s ended", self.parent_run_id,
                           exc_info=True)

    def _children_from_store(self) -> dict[int, str]:
        try:
            runs = self.client.search_runs(
                [self.experiment_id], f"tags.mlflow.parentRunId = '{self.parent_run_id}'")
        except Exception:  # noqa: BLE001
            logger.warning("MLflow: could not list the trial runs of study run %s",
                           self.parent_run_id, exc_info=True)
            return {}
        return {int(r.data.tags["pipetune.trial_id"]): r.info.run_id for r in runs
                if "pipetune.trial_id" in r.data.tags}


def profile_rows(trial: Trial) -> list[dict[str, Any]]:
    """One row per epoch: phase, system config and every profile feature."""
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
    return rows
