"""A study opened (:class:`OpenedStudy`): run to its end over a backend, its records
kept as it goes, its summary returned; a failure or a stop recorded on the way out."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipetune.errors import BrokenWorkload, CheckpointWriteError, PipetuneError
from pipetune.states import TrialState
from pipetune.watching import _OBSERVING, NOTICE

if TYPE_CHECKING:
    from pipetune.backends import EpochBackend
    from pipetune.checkpoints import CheckpointStore
    from pipetune.engine.events import Observer, StudyEvent
    from pipetune.engine.journal import StudyJournal
    from pipetune.engine.study import Study
    from pipetune.engine.trial import Trial
    from pipetune.spec import SpaceDrop
    from pipetune.tracking import StudyTracker
    from pipetune.tracking.api import Tracker


@dataclass
class OpenedStudy:
    """A study ready for its first epoch (what :func:`open_study` returns)."""

    study: Study
    journal: StudyJournal
    tracker: StudyTracker
    checkpoints: CheckpointStore
    #: The Dask client of the cluster its epochs run on.
    client: Any
    tracking_uri: str
    dropped: tuple[SpaceDrop, ...]
    log: logging.Logger | logging.LoggerAdapter
    #: What refused the study's MLflow run when it was opened beside the training
    #: (:attr:`~pipetune.session.opening.StudyOptions.start_first`): the study stops
    #: with it.
    refused: list[BaseException] = field(default_factory=list)
    #: The job's own trackers (``tracking.trackers``), beside MLflow's :attr:`tracker`.
    trackers: list[Tracker] = field(default_factory=list)

    @property
    def study_id(self) -> str:
        return self.study.study_id

    def _run_ids_known(self) -> dict[str, str]:
        """The study's MLflow run id for its journal, where known by now (not waited for)."""
        ids = self.tracker._ids  # noqa: SLF001 - read only
        return {"parent_run_id": ids[1]} if ids and ids[1] else {}

    def runs_known(self, flow_run_id: str | None = None) -> None:
        """What a study started first learns once its records answer: its MLflow run
        (waited for here) in the journal, and the Prefect flow run it belongs to on its
        MLflow runs and in the journal (``--resume`` finds it by that id)."""
        changes: dict[str, Any] = {"parent_run_id": self.tracker.parent_run_id}
        if flow_run_id:
            self.tracker.add_tags({"prefect.flow_run_id": flow_run_id})
            changes["flow_run_id"] = flow_run_id
        self.journal.update(**changes)

    def dask_backend(self) -> EpochBackend:
        """The backend that runs this study's epochs on its cluster."""
        from pipetune.dask.backend import DaskBackend

        return DaskBackend(self.client)

    def run(self, backend: EpochBackend, *,
            observers: Sequence[Observer] = ()) -> dict[str, Any]:
        """Drive the study to its end over ``backend`` and return its summary.

        Every finished epoch and ended trial is recorded as it happens (MLflow, the
        pruned checkpoints, one line per failed trial); the end re-evaluates the best
        trial from its checkpoint (proving it) and writes the summary. A failure or a
        stop (Ctrl-C, a SIGTERM or SIGHUP: :func:`_is_stop`) ends the
        MLflow record ``FAILED`` or ``KILLED`` with its reason and leaves the journal
        resumable; it is raised again (a :class:`PipetuneError` carrying the study's id
        as ``study_id``). ``backend.close`` is called either way. ``observers`` (and
        those of an enclosing :func:`~pipetune.watching.observing`) hear the engine's events
        (:mod:`pipetune.engine.events`) after the study's own records have, and, last, a
        :class:`~pipetune.engine.events.StudyFinished` with the summary returned here."""
        from pipetune.engine.events import StudyFinished
        from pipetune.reports import load_in_background, orchestration_overhead, overhead_summary

        study, tracker, log = self.study, self.tracker, self.log
        attached = [study.observe(self._observe), *map(study.observe, self.trackers),
                    *map(study.observe, observers), *map(study.observe, _OBSERVING.get())]
        if study.ground_truth is not None:  # fit its clusters while epoch 1 runs
            study.ground_truth.prepare_in_background()
        load_in_background()  # what the end draws with, loaded while it trains
        started = time.time()
        try:
            study.run(backend)
            if study.broken is not None and study.broken.store:  # a full store
                raise CheckpointWriteError(study.broken.line)
            if study.broken is not None:  # trials kept failing the same way: broken code
                raise BrokenWorkload(f"{study.broken.line} (and traceback.txt on the MLflow "
                                     f"run of trial {study.broken.trial_id})")
            extra = evaluate_best(study, backend)
            for trial in study.trials.values():  # a woken worker's late write, again
                self.checkpoints.prune_superseded(trial.results)
            extra["checkpoints_pruned"] = float(self.checkpoints.wait_pruned())
            wall_s = time.time() - started
            timings = orchestration_overhead(study)
            extra.update(overhead_summary(timings))
            tracker.finish(study, wall_s=wall_s, extra_metrics=extra)
            if tracker.waiting is not None:  # MLflow did not answer: its writes wait
                log.warning("%s", tracker.waiting.line(), extra=NOTICE)
        except BaseException as stop:
            self._ended_badly(stop, backend)
            raise
        finally:
            for observer in attached:
                study.unobserve(observer)
        self.journal.update(status="finished", **self._run_ids_known())
        self.journal.close()
        try:  # the study is done and in MLflow; a lost side record is not worth failing it
            backend.close()
        except Exception as e:  # noqa: BLE001
            log.warning("the task-run record is incomplete: %s (the study finished; MLflow "
                        "has all of it)", e, extra=NOTICE)
        summary = study.summary()
        self._say_summary(summary, wall_s)
        result = self._summary_dict(summary, started, wall_s, extra, timings)
        self._end_trackers(lambda t: t.finished(result))
        finished = StudyFinished(summary=result)
        for observer in (*observers, *_OBSERVING.get()):
            observer(finished)
        return result

    def _ended_badly(self, stop: BaseException, backend: EpochBackend) -> None:
        """A study that failed or was stopped (:func:`_is_stop`): its journal says so
        (resumable with ``--resume`` either way), its epochs are cancelled, its records
        end ``FAILED`` or ``KILLED`` with the reason, the backend closes. ``stop`` learns
        the study's id (a :class:`PipetuneError`), for the caller to say where it is."""
        study, tracker, log = self.study, self.tracker, self.log
        if isinstance(stop, PipetuneError) and getattr(stop, "study_id", None) is None:
            stop.study_id = study.study_id  # which study a caller finds it in
        stopped = _is_stop(stop)
        reason = str(stop) if isinstance(stop, PipetuneError) else \
            f"{type(stop).__name__}: {stop}"
        with contextlib.suppress(Exception):  # resumable with --resume either way
            self.journal.update(status="stopped" if stopped else "failed", reason=reason,
                                **self._run_ids_known())
            self.journal.close()
        with contextlib.suppress(Exception):
            backend.cancel()
        tracker.fail(status="KILLED" if stopped else "FAILED",
                     timeout=3 if stopped else 120, reason=reason)
        self._end_trackers(lambda t: t.failed("KILLED" if stopped else "FAILED", reason))
        with contextlib.suppress(Exception):  # a run opened beside the study: its id
            if self._run_ids_known():
                self.journal.update(**self._run_ids_known())
        if tracker.waiting is not None:
            log.warning("%s", tracker.waiting.line(), extra=NOTICE)
        with contextlib.suppress(Exception):
            backend.close(timeout=1 if stopped else 60)

    def _end_trackers(self, end: Callable[[Tracker], None]) -> None:
        """``end(tracker)`` then ``close()`` for each of the job's own trackers; one that
        raises is one line, and the others still end (the study is over either way)."""
        for tracker in self.trackers:
            for step in (end, type(tracker).close):
                try:
                    step(tracker)
                except Exception as e:  # noqa: BLE001 - a tracker of the user's own
                    self.log.warning("tracker %s: %s: %s", type(tracker).__name__,
                                     type(e).__name__, e, extra=NOTICE)
                    break

    # -- what it records, says and returns -------------------------------------------------
    def _observe(self, event: StudyEvent) -> None:
        """The study's own observer: each finished epoch and ended trial into MLflow, an
        ended trial's other checkpoints pruned, one line per ended trial."""
        from pipetune.engine.events import TrialEnded

        study = self.study
        if self.refused:  # the tracking store never opened the study's run
            raise self.refused[0]
        self.tracker(event)  # MLflow's record: the epoch's metrics, the trial's outcome
        if isinstance(event, TrialEnded):
            self._say_ended(event.trial)
            self.checkpoints.prune_trial(event.trial.results, study.metric, study.mode)

    def _say_ended(self, trial: Trial) -> None:
        if trial.state == TrialState.FAILED:  # one line; the traceback is in the file and on MLflow
            where = f" (traceback: {trial.traceback_file})" if trial.traceback_file else ""
            self.log.warning("trial %s failed: %s%s", trial.trial_id, trial.error, where,
                             extra=NOTICE)
            return
        value = trial.last_value(self.study.metric)
        self.log.info("trial %d %s after %d epoch(s): %s %s under %s", trial.trial_id,
                      trial.state, trial.epochs_run, self.study.metric,
                      "-" if value is None else f"{value:.4g}",
                      trial.final_system.label() if trial.final_system else "-")

    def _say_summary(self, summary: Any, wall_s: float) -> None:
        study = self.study
        best = (f"best {study.metric} {summary.best_value:.4g} (trial {summary.best_trial}) "
                f"params {summary.best_params} under {summary.best_system.label()}"
                if summary.best_value is not None and summary.best_system
                else "no trial finished")
        self.log.info(
            "study %s done in %.1f s: %s; %d trials (%d completed, %d stopped, %d failed), "
            "%d epochs, %d probe epochs, ground-truth hits %d/%d", study.study_id, wall_s,
            best, summary.trials, summary.completed, summary.stopped, summary.failed,
            summary.epochs_run, summary.probe_epochs, summary.groundtruth_hits,
            summary.groundtruth_lookups)

    def _summary_dict(self, summary: Any, started: float, wall_s: float,
                      extra: dict[str, float], timings: Any) -> dict[str, Any]:
        """The JSON-able summary: ids, the study's numbers, timings, the trials table."""
        study, tracker = self.study, self.tracker
        return {
            "study_id": study.study_id,
            "parent_run_id": tracker.parent_run_id,
            "tracking_uri": self.tracking_uri,
            "experiment_id": tracker.experiment_id,
            "tuning_wall_s": wall_s,
            "resumed_epochs": study.resumed_epochs,
            "started_at": started,
            "first_epoch_at": min((t[1] for t in study.epoch_times.values()), default=started),
            **summary.to_metrics(),
            "best_params": summary.best_params,
            "best_system": summary.best_system.label() if summary.best_system else None,
            "energy_source": summary.energy_source,
            **{k: v for k, v in extra.items() if k.startswith("orchestration_")},
            "checkpoints_pruned": int(extra.get("checkpoints_pruned", 0)),
            "epoch_timings": timings,
            "trials_table": [
                {"trial": t.trial_id, "outcome": t.state, "epochs": t.epochs_run,
                 "probe_epochs": t.probe_epochs, study.metric: t.last_value(study.metric),
                 "system": t.final_system.label() if t.final_system else "",
                 "error": t.error or "", "traceback": t.traceback_file or ""}
                for t in sorted(study.trials.values(), key=lambda t: t.trial_id)
            ],
        }


def _is_stop(error: BaseException) -> bool:
    """Whether ``error`` stopped the study (Ctrl-C, pipetune's SIGTERM/SIGHUP, or the
    flow engine's own SIGTERM handler, found by name: the library never imports Prefect)
    rather than failed it (a cancelled Dask future is a failure)."""
    return isinstance(error, KeyboardInterrupt) or any(
        cls.__name__ == "TerminationSignal" for cls in type(error).__mro__)


def evaluate_best(study: Study, backend: EpochBackend) -> dict[str, float]:
    """Re-evaluate the best trial from its last checkpoint, proving the checkpoint."""
    best = study.best_trial()
    if best is None or best.checkpoint is None:
        return {}
    metrics = backend.evaluate(study.final_task(best), best.checkpoint)
    return {f"best_checkpoint_{k}": v for k, v in metrics.items()}
