"""The study's view of its MLflow record: :class:`StudyTracker` creates (or resumes) the
parent run, sends each epoch and trial outcome to an :class:`~pipetune.tracking.sink.MlflowSink`
and writes the study's summary, tables and best model at the end."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipetune.states import TrialState
from pipetune.tracking.api import Tracker
from pipetune.tracking.names import (  # PHASE_CODES, phase_runs, profile_rows: re-exported
    PHASE_CODES,
    _ms_ceil,
    _ms_floor,
    epoch_writes,
    phase_runs,
    profile_rows,
    study_files,
    study_metric_name,
    study_params,
    trial_end_writes,
    trial_started,
)
from pipetune.tracking.sink import MlflowSink
from pipetune.tracking.spool import SpoolNote, spool_path
from pipetune.tracking.store import DEFAULT_EXPERIMENT, mlflow_client

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from pipetune.engine.events import StudyEvent
    from pipetune.engine.study import Study, Trial
    from pipetune.runner import EpochResult
    from pipetune.spec import JobSpec

logger = logging.getLogger(__name__)

__all__ = ["FIND_STUDY_RUN", "PHASE_CODES", "StudyTracker", "phase_runs", "profile_rows",
           "study_metric_name"]

#: ``resume_run_id`` of a resumed study whose journal never heard its run's id (killed
#: before the run, opened beside the training, answered): the store is searched for it.
FIND_STUDY_RUN = "find"


class StudyTracker(Tracker):
    """Writes a study to MLflow as it runs.

    Per-epoch metrics are logged with ``step = epoch`` and the time the epoch finished
    on its worker; every system knob is logged as a metric too so the UI can plot the
    config against the epoch, and the epoch's phase as ``phase_code``
    (:data:`~pipetune.tracking.names.PHASE_CODES`). A trial's run starts when its first
    epoch started on its worker (:func:`trial_started`; what came before, a worker's
    start-up or a wait for a slot, is its ``startup_s``) and ends when
    :meth:`end_trial` is called; the study's run starts when the tracker is built and
    ends at :meth:`finish`. Its metrics are named apart (:func:`study_metric_name`).

    Every write goes through an :class:`MlflowSink`: in this process's recorder
    process (:func:`pipetune.sidecar.shared_host`), off the study loop's GIL, so this
    process never loads MLflow; or in a thread when ``client`` (an ``MlflowClient``
    replacing the one built from ``tracking_uri``) is given. The parent run is created
    and described at construction (waiting for the sink). Everything per trial
    (:meth:`log_epoch`, :meth:`end_trial`) is sent and returns at once. :meth:`flush`
    waits for what was sent and raises what a write raised. :meth:`finish` and
    :meth:`fail` write what was sent first and stop the sink; :meth:`close` stops it
    alone. :attr:`client` is a client in this process, built when first asked for.

    A study's writes the store does not answer (a tracking server down or restarting,
    a SQLite store locked past the back-off) wait in ``spool`` (default: the study's
    folder, when ``tags`` name its ``pipetune.study_id``; :mod:`pipetune.tracking.spool`)
    and are sent in order when it answers; nothing here waits for them. A study that
    ends with writes still waiting keeps what waits in :attr:`waiting`, whose
    :meth:`SpoolNote.line` its caller says (how to send them later).
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
        spool: str | Path | None = None,
        defer_open: bool = False,
    ):

        from pipetune.sidecar import ThreadHost, shared_host

        self.tracking_uri = tracking_uri
        self._client = client
        self.spec = spec
        self.tags = dict(tags or {})
        self.started = time.time()
        #: The latest time (ms) written as a trial's metric or end, so the study's run
        #: ends after every trial run however the workers' clocks go.
        self._latest_ms = _ms_ceil(self.started)
        #: trial id -> child run id, as last heard from the sink.
        self._children: dict[int, str] = {}
        #: trial ids whose child run was sent for creation.
        self._requested: set[int] = set()
        self._thread_host: ThreadHost | None = None
        #: (experiment id, parent run id), once the sink has said them.
        self._ids: tuple[str, str] | None = None
        self._defer_open = defer_open
        #: What the study left waiting in its spool when it ended (None: nothing).
        self.waiting: SpoolNote | None = None
        if spool is None and self.tags.get("pipetune.study_id"):
            spool = spool_path(self.tags["pipetune.study_id"])
        spool = None if spool is None else str(spool)
        self._spool = spool
        # The sink opens the study's run as it writes the rest: in the recorder process
        # unless a client is given, so this process never loads MLflow.
        if client is not None:
            self._thread_host = ThreadHost("pipetune-mlflow-writer")
            self._sink = self._thread_host.attach(
                MlflowSink(client=client, tracking_uri=tracking_uri, tags=self.tags,
                           spool=spool), "mlflow")
        else:
            self._sink = shared_host().attach(
                "pipetune.tracking.sink:MlflowSink", "mlflow", tracking_uri=tracking_uri,
                tags=self.tags, spool=spool)
        try:
            if resume_run_id == FIND_STUDY_RUN:  # a resumed study whose journal lacks it
                resume_run_id = self._sink.call("find_study_run", experiment)
            if resume_run_id is not None:
                self._resume(resume_run_id, experiment)
            else:
                self._create(spec, run_name, experiment)
        except BaseException:
            self._drop_sink()
            raise

    @property
    def experiment_id(self) -> str:
        return self._study_ids()[0]

    @property
    def parent_run_id(self) -> str:
        """The study's MLflow run; with ``defer_open``, asked of the sink the first time
        (waiting until the store answered the run's creation)."""
        return self._study_ids()[1]

    def _study_ids(self) -> tuple[str, str]:
        if self._ids is None:
            if self._sink.closed:  # never opened (its store never answered)
                return "", ""
            self._ids = tuple(self._sink.call("study_ids"))  # type: ignore[assignment]
        assert self._ids is not None
        return self._ids

    def add_tags(self, tags: dict[str, str], timeout: float | None = 60.0) -> None:
        """Tags learned after the study started (the Prefect flow run it belongs to),
        on the study's run and every trial run, those to come included. After the
        study's end (its sink closed), a sink of its own writes them, and this waits
        for it (at most ``timeout`` s)."""
        self.tags.update(tags)
        if not self._sink.closed:
            self._sink.send("add_tags", dict(tags))
            return
        experiment_id, parent_run_id = self._study_ids()
        if not parent_run_id:
            return
        if self._thread_host is not None:  # MLflow is loaded here: write them from here
            for run_id in (parent_run_id, *self._children.values()):
                for key, value in tags.items():
                    self.client.set_tag(run_id, key, value)
            return
        from pipetune.sidecar import shared_host

        late = shared_host().attach(
            "pipetune.tracking.sink:MlflowSink", "mlflow-tags",
            tracking_uri=self.tracking_uri, tags=self.tags, experiment_id=experiment_id,
            parent_run_id=parent_run_id, children=dict(self._children), spool=self._spool)
        try:
            late.send("add_tags", dict(tags))
        finally:
            late.close(timeout)

    @property
    def client(self) -> Any:
        """An MLflow client on the study's store in this process (built on first use:
        the tracker itself writes through its sink)."""
        if self._client is None:
            self._client = mlflow_client(self.tracking_uri)
        return self._client

    def _drop_sink(self) -> None:
        with contextlib.suppress(Exception):
            self._sink.close(timeout=10)
        if self._thread_host is not None:
            with contextlib.suppress(Exception):
                self._thread_host.stop(10)

    def _resume(self, run_id: str, experiment: str) -> None:
        """Continue the parent run ``run_id`` and its trial runs (a resumed study)."""
        experiment_id, self._children = self._sink.call("resume_study", run_id, experiment)
        self._ids = (experiment_id, run_id)
        self._requested = set(self._children)

    def reopen_trials(self, trial_ids: list[int]) -> None:
        """Trial runs ended by the stop (KILLED, or FAILED when the checkpoint store
        refused them) are running again: their trials go on."""
        runs = [self._children[t] for t in trial_ids if t in self._children]
        if runs:
            self._sink.call("reopen", runs)

    def _create(self, spec: JobSpec, run_name: str | None, experiment: str) -> None:
        args = ("open_study", experiment, run_name or spec.name,
                {**self.tags, "pipetune.kind": "study", "pipetune.job": spec.name},
                study_params(spec), study_files(spec), _ms_floor(self.started))
        if self._defer_open:  # the store is created and the run opened beside the study
            self._sink.send(*args)
        else:
            self._ids = tuple(self._sink.call(*args))  # type: ignore[assignment]

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
            self._study_ids()  # known before the sink goes
        finally:
            self._sink.close(timeout)
            if self._thread_host is not None:
                self._thread_host.stop(timeout)

    @property
    def artifact_uri(self) -> str:
        """The study run's artifact location (``mlflow-artifacts:/...`` on a tracking
        server with ``--serve-artifacts``)."""
        if self._sink.closed:
            return self.client.get_run(self.parent_run_id).info.artifact_uri
        return self._sink.call("artifact_uri")

    # -- trials -----------------------------------------------------------------------
    def _child(self, trial: Trial) -> tuple[str, int]:
        """The sink's key of the trial's child run; the run is created (by the sink)
        the first time a trial is seen."""
        if trial.trial_id not in self._requested:
            params = [(k, json.dumps(v) if not isinstance(v, str) else v)
                      for k, v in sorted(trial.params.items())]
            params.append(("seed", str(trial.seed)))
            self._sink.send("create_child", trial.trial_id, _ms_floor(trial_started(trial)))
            self._requested.add(trial.trial_id)
            self._sink.send("log", ("trial", trial.trial_id), (), params, ())
        return ("trial", trial.trial_id)

    def __call__(self, event: StudyEvent) -> None:
        """The :class:`~pipetune.tracking.Tracker` side: each finished epoch's metrics,
        each ended trial's outcome. The study's own end (its summary, tables and best
        model) is written by :meth:`finish` or :meth:`fail`, which the session calls with
        what only it has (the study, its wall time)."""
        if event.name == "epoch_finished":
            self.log_epoch(event.trial, event.result)
        elif event.name == "trial_ended":
            self.end_trial(event.trial, metric=self.spec.objective.metric)

    def log_epoch(self, trial: Trial, result: EpochResult) -> None:
        """Send the metrics of one finished epoch, at ``step = epoch``."""
        run = self._child(trial)
        metrics, tags = epoch_writes(self.spec.objective.system, trial, result)
        self._latest_ms = max(self._latest_ms, metrics[0][3])
        self._sink.send("log", run, metrics, (), tags)

    def end_trial(self, trial: Trial, *, metric: str) -> None:
        """Send the outcome, profile table and the config the trial settled on, then the
        end of the trial's run: now, or its last epoch's end on its worker if later."""
        run = self._child(trial)
        ended = time.time()
        if trial.results:
            ended = max(ended, trial.results[-1].finished)
        end_ms = _ms_ceil(ended)
        self._latest_ms = max(self._latest_ms, end_ms)
        metrics, params, tags = trial_end_writes(trial, metric, ended)
        self._sink.send("log", run, metrics, params, tags)
        if trial.results:
            self._sink.send("log_profiles", run, profile_rows(trial))
        if trial.failure is not None:  # the whole traceback, beside the one-line tag
            self._sink.send("log_text", run, trial.failure.traceback, "traceback.txt")
        status = "FAILED" if trial.state == TrialState.FAILED else "FINISHED"
        self._sink.send("terminate", run, status, end_ms)

    # -- the study ----------------------------------------------------------------------
    def finish(self, study: Study, *, wall_s: float,
               extra_metrics: dict[str, float] | None = None) -> None:
        """Summary metrics, trials table, timeline picture and best model on the parent run.

        The metrics are the summary's (:meth:`StudySummary.to_metrics`),
        ``tuning_wall_s`` and ``extra_metrics``, each named by :func:`study_metric_name`.
        The run ends now (after every trial run). The sink writes everything sent before
        them first (raising what a write raised), and is closed last."""
        from pipetune.reports import timeline_figure, trials_table

        summary = study.summary()
        metrics = {study_metric_name(k): v for k, v in
                   {**summary.to_metrics(), "tuning_wall_s": wall_s,
                    **(extra_metrics or {})}.items()}
        ended = time.time()
        ts = _ms_floor(ended)
        end_ms = max(_ms_ceil(ended), self._latest_ms)
        tags = [("energy_source", summary.energy_source)]
        params = []
        if summary.best_params is not None:
            params.append(("best_params", json.dumps(summary.best_params, sort_keys=True)))
        if summary.best_system is not None:
            params.append(("best_system", summary.best_system.label()))
        best = study.best_trial()
        best_model = None
        if best is not None and best.checkpoint is not None:
            from pipetune.tracking.best_model import best_model_record

            record = best_model_record(study, best)
            best_model = (best.checkpoint, record, record["load_recipe"])
        # The sink writes the summary and the best model while this process makes the
        # trials table and draws the timeline (each a few tenths of a second); the run
        # ends FINISHED with them. A failed write is raised by the second call.
        self._sink.send(
            "finish_study", [(k, float(v), 0, ts) for k, v in metrics.items()], params, tags,
            (), (), best_model, summary.best_trial, False)
        table = trials_table(study).to_csv(index=False)
        png = io.BytesIO()
        timeline_figure(study).savefig(png, format="png")  # as MLflow's log_figure saves it
        self._note(self._sink.call("finish_study", (), (), (), [(table, "trials.csv")],
                                   [(png.getvalue(), "timeline.png")], None, None, True,
                                   end_ms))
        self.close()

    def _note(self, waiting: SpoolNote | None) -> None:
        self.waiting = waiting
        if waiting is not None:
            logger.info("%s", waiting.line())  # the caller says it, once (session)

    def fail(self, *, timeout: float | None = 120.0, status: str = "FAILED",
             reason: str | None = None) -> None:
        """End the study as failed: still-running child runs KILLED, the parent
        ``status`` (``FAILED``, or ``KILLED`` when the study was stopped), tagged
        ``pipetune.failure`` with ``reason`` when given.

        Writes everything sent first (waiting at most ``timeout`` seconds), so what was
        recorded before the failure is kept. Never raises: what cannot be written (a
        background write that failed, a store that is down) is logged."""
        end_ms = max(_ms_ceil(time.time()), self._latest_ms)
        if not self._sink.closed:
            try:
                self._note(self._sink.call("fail_study", status, reason, end_ms,
                                           timeout=timeout))
                with contextlib.suppress(Exception):
                    self._study_ids()  # known before the sink goes
            except Exception as e:  # noqa: BLE001 - failing already; say what was lost,
                # and end the runs from here (the recorder may be gone)
                logger.warning("MLflow: some writes of study run %s were lost",
                               self.parent_run_id, exc_info=True)
                # What waits in the spool is still said. The error may be an earlier
                # one the recorder kept, or have lost its note crossing processes (an
                # MLflow RestException pickles without its attributes): ask again.
                note = getattr(e, "spool_note", None)
                if note is None:
                    with contextlib.suppress(Exception):
                        note = self._sink.call("waiting", timeout=5)
                self._note(note)
            else:
                with contextlib.suppress(Exception):
                    self.close(timeout)
                return
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
                    self.client.set_terminated(run_id, status="KILLED", end_time=end_ms)
            except Exception:  # noqa: BLE001
                logger.warning("MLflow: could not end the run of trial %s", trial_id,
                               exc_info=True)
        try:
            if reason:
                self.client.set_tag(self.parent_run_id, "pipetune.failure", reason[:5000])
            self.client.set_terminated(self.parent_run_id, status=status, end_time=end_ms)
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
