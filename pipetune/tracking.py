"""MLflow record of a study: one parent run, one child run per trial.

Only the process that owns the study loop writes here; workers return results. The
tracking store and the experiment are created once, before any fan-out (several
processes creating one fresh SQLite store at once fail).

Per-trial writes (child runs, epoch metrics, trial outcomes) go through a
:class:`_BackgroundWriter`, so the study loop never waits on the tracking store: one
daemon thread drains a queue, merging what is queued for a run into batched
``log_batch`` calls. :meth:`StudyTracker.flush` waits for everything queued so far.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

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


logger = logging.getLogger(__name__)

#: MLflow's limits on one ``log_batch`` call (``mlflow.utils.validation``).
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
MAX_TAGS_PER_BATCH = 100
MAX_ENTITIES_PER_BATCH = 1000


def batches(
    metrics: Sequence[Metric], params: Sequence[Param], tags: Sequence[RunTag]
) -> Iterator[tuple[list[Metric], list[Param], list[RunTag]]]:
    """Split one run's writes into ``log_batch`` calls within MLflow's limits, in order."""
    m, p, t = 0, 0, 0
    while m < len(metrics) or p < len(params) or t < len(tags):
        ps = list(params[p:p + MAX_PARAMS_PER_BATCH])
        ts = list(tags[t:t + MAX_TAGS_PER_BATCH])
        room = min(MAX_METRICS_PER_BATCH, MAX_ENTITIES_PER_BATCH - len(ps) - len(ts))
        ms = list(metrics[m:m + room])
        m, p, t = m + len(ms), p + len(ps), t + len(ts)
        yield ms, ps, ts


@dataclass
class _Log:
    run: Hashable
    metrics: list[Metric]
    params: list[Param]
    tags: list[RunTag]


@dataclass
class _Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]


@dataclass
class _Barrier:
    done: threading.Event = field(default_factory=threading.Event)


class _Stop:
    pass


@dataclass
class _Buffer:
    """What is queued for one run: metrics in order, params and tags by key (last wins,
    as writing them one after the other would leave them)."""

    metrics: list[Metric] = field(default_factory=list)
    params: dict[str, Param] = field(default_factory=dict)
    tags: dict[str, RunTag] = field(default_factory=dict)

    def add(self, item: _Log) -> None:
        self.metrics.extend(item.metrics)
        self.params.update((x.key, x) for x in item.params)
        self.tags.update((x.key, x) for x in item.tags)


class WriterError(RuntimeError):
    """The background MLflow writer cannot finish what was queued (it died or timed out)."""


class _BackgroundWriter:
    """One daemon thread that writes to MLflow in the order things were queued.

    :meth:`log` queues metrics, params and tags for a run; whatever is queued for a
    run by the time the thread gets to it is merged into as few ``log_batch`` calls as
    MLflow's limits allow. :meth:`call` queues any other write (creating a run,
    an artifact, terminating a run); it runs after everything queued before it.
    ``run`` is a run id, or any key that ``resolve`` turns into one in the writer
    thread (a run the writer itself creates).

    An exception in the thread is kept (the first one; later ones are logged and
    counted) and raised by the next :meth:`flush` or :meth:`close`; the thread goes on
    with what follows.
    """

    def __init__(self, client: MlflowClient, *,
                 resolve: Callable[[Hashable], str] | None = None,
                 name: str = "pipetune-mlflow-writer"):
        self.client = client
        self._resolve = resolve or (lambda run: str(run))
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._error: BaseException | None = None
        self._more_errors = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- the caller's side -----------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def log(self, run: Hashable, *, metrics: Sequence[Metric] = (),
            params: Sequence[Param] = (), tags: Sequence[RunTag] = ()) -> None:
        self._put(_Log(run, list(metrics), list(params), list(tags)))

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        self._put(_Call(fn, args))

    def _put(self, item: Any) -> None:
        with self._lock:
            if self._closed:
                raise WriterError("the MLflow writer is closed")
            self._queue.put(item)

    def flush(self, timeout: float | None = None) -> None:
        """Block until everything queued so far is written; raise what the thread raised.

        ``timeout`` (seconds): raise :class:`WriterError` if the writes take longer."""
        barrier = _Barrier()
        with self._lock:
            if self._closed:
                barrier.done.set()
            else:
                self._queue.put(barrier)
        self._wait(barrier.done.wait, timeout)
        self.raise_pending()

    def close(self, timeout: float | None = None) -> None:
        """Write everything queued, stop the thread, raise what it raised. Idempotent."""
        with self._lock:
            first = not self._closed
            if first:
                self._closed = True
                self._queue.put(_Stop())
        if first or self._thread.is_alive():
            self._wait(self._join, timeout)
        self.raise_pending()

    def _join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _wait(self, wait: Callable[[float], bool], timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = 0.5 if deadline is None else min(0.5, max(deadline - time.monotonic(), 0))
            if wait(step):
                return
            if not self._thread.is_alive():
                self.raise_pending()
                raise WriterError("the MLflow writer thread is gone; queued writes are lost")
            if deadline is not None and time.monotonic() >= deadline:
                raise WriterError(f"MLflow writes not done after {timeout} s")

    def raise_pending(self) -> None:
        with self._lock:
            error, more = self._error, self._more_errors
            self._error, self._more_errors = None, 0
        if error is not None:
            if more:
                error.add_note(f"({more} more MLflow write(s) failed after this one)")
            raise error

    # -- the writer thread -----------------------------------------------------------
    def _record(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
            else:
                self._more_errors += 1
        logger.warning("MLflow write failed: %s: %s", type(error).__name__, error)

    def _run(self) -> None:
        pending: dict[Hashable, _Buffer] = {}
        try:
            while True:
                items = [self._queue.get()]
                while True:
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                for item in items:
                    if isinstance(item, _Log):
                        pending.setdefault(item.run, _Buffer()).add(item)
                        continue
                    self._write(pending)  # what was queued before goes first
                    if isinstance(item, _Call):
                        try:
                            item.fn(*item.args)
                        except Exception as e:  # noqa: BLE001 - kept for flush()
                            self._record(e)
                    elif isinstance(item, _Barrier):
                        item.done.set()
                    elif isinstance(item, _Stop):
                        return
                self._write(pending)
        except BaseException as e:  # noqa: BLE001 - the thread dies; flush() says so
            self._record(e)

    def _write(self, pending: dict[Hashable, _Buffer]) -> None:
        for run, buf in pending.items():
            try:
                run_id = self._resolve(run)
                for metrics, params, tags in batches(
                    buf.metrics, list(buf.params.values()), list(buf.tags.values())
                ):
                    self.client.log_batch(run_id, metrics=metrics, params=params, tags=tags)
            except Exception as e:  # noqa: BLE001 - kept for flush()
                self._record(e)
        pending.clear()


class StudyTracker:
    """Writes a study to MLflow as it runs.

    Per-epoch metrics are logged with ``step = epoch``; every system knob is logged as
    a metric too so the UI can plot the config against the epoch.

    The parent run is created and described at construction. Everything per trial
    (:meth:`log_epoch`, :meth:`end_trial`) is queued to a background writer and returns
    at once; :meth:`flush` waits for it and raises what a write raised. :meth:`finish`
    and :meth:`fail` flush first and stop the writer; :meth:`close` stops it alone.
    ``client`` replaces the ``MlflowClient`` built from ``tracking_uri``.
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
    ):
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        self.client = client if client is not None else MlflowClient(tracking_uri)
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
        #: trial id -> child run id, filled in by the writer thread as it creates them.
        self._children: dict[int, str] = {}
        #: trial ids whose child run is queued for creation (the caller's side).
        self._requested: set[int] = set()
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
        self._writer = _BackgroundWriter(self.client, resolve=self._run_id)

    # -- the background writer ----------------------------------------------------------
    def flush(self, timeout: float | None = None) -> None:
        """Wait until every write queued so far is in MLflow; raise the first exception a
        background write raised since the last flush (``WriterError`` past ``timeout``)."""
        self._writer.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flush and stop the background writer (idempotent). Later per-trial calls raise."""
        self._writer.close(timeout)

    def _run_id(self, run: Hashable) -> str:
        """The run id behind a writer key: a run id, or ``("trial", trial_id)``."""
        if isinstance(run, tuple):
            trial_id = run[1]
            try:
                return self._children[trial_id]
            except KeyError:
                raise WriterError(
                    f"trial {trial_id} has no MLflow run (creating it failed)"
                ) from None
        return str(run)

    # -- trials -----------------------------------------------------------------------
    def _child(self, trial: Trial) -> tuple[str, int]:
        """The writer key of the trial's child run; the run is created (in the writer
        thread) the first time a trial is seen."""
        if trial.trial_id not in self._requested:
            from mlflow.entities import Param

            params = [Param(k, json.dumps(v) if not isinstance(v, str) else v)
                      for k, v in sorted(trial.params.items())]
            params.append(Param("seed", str(trial.seed)))
            self._writer.call(self._create_child, trial.trial_id)
            self._requested.add(trial.trial_id)
            self._writer.log(("trial", trial.trial_id), params=params)
        return ("trial", trial.trial_id)

    def _create_child(self, trial_id: int) -> None:  # in the writer thread
        run = self.client.create_run(
            self.experiment_id,
            run_name=f"trial-{trial_id}",
            tags={
                **self.tags,
                "mlflow.parentRunId": self.parent_run_id,
                "pipetune.kind": "trial",
                "pipetune.trial_id": str(trial_id),
            },
        )
        self._children[trial_id] = run.info.run_id

    def child_run_id(self, trial_id: int) -> str | None:
        """The trial's child run id (waits for the writer if the run is still queued)."""
        if (trial_id in self._requested and trial_id not in self._children
                and not self._writer.closed):
            self.flush()
        return self._children.get(trial_id)

    def log_epoch(self, trial: Trial, result: EpochResult) -> None:
        """Queue the metrics of one finished epoch, at ``step = epoch``."""
        from mlflow.entities import RunTag

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
        self._writer.log(run, metrics=metrics, tags=tags)

    def end_trial(self, trial: Trial, *, metric: str, objective: str) -> None:
        """Queue the outcome, profile table and the config the trial settled on, then the
        end of the trial's run."""
        from mlflow.entities import RunTag

        run = self._child(trial)
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
        self._writer.log(run, metrics=metrics, tags=tags)
        if trial.results:
            snapshot = copy.copy(trial)  # the writer reads it later
            snapshot.results = list(trial.results)
            self._writer.call(self._log_profiles, run, snapshot)
        status = "FAILED" if trial.state == "failed" else "FINISHED"
        self._writer.call(self._terminate, run, status)

    def _log_profiles(self, run: Hashable, trial: Trial) -> None:  # in the writer thread
        self.client.log_text(self._run_id(run), profiles_csv(trial), "profiles.csv")

    def _terminate(self, run: Hashable, status: str) -> None:  # in the writer thread
        self.client.set_terminated(self._run_id(run), status=status)

    # -- the study ----------------------------------------------------------------------
    def finish(self, study: Study, *, wall_s: float, extra_metrics: dict[str, float] | None = None,
               failed: bool = False) -> None:
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
        self.close()

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

    def fail(self, *, timeout: float | None = 120.0) -> None:
        """End the study as failed: still-running child runs KILLED, the parent FAILED.

        Writes everything queued first (waiting at most ``timeout`` seconds), so what was
        recorded before the failure is kept. Never raises: what cannot be written (a
        background write that failed, a store that is down) is logged."""
        try:
            self._writer.close(timeout)
        except Exception:  # noqa: BLE001 - failing already; say what was lost
            logger.warning("MLflow: some writes of study run %s were lost",
                           self.parent_run_id, exc_info=True)
        for trial_id, run_id in sorted(self._children.items()):
            try:
                run = self.client.get_run(run_id)
                if run.info.status == "RUNNING":
                    self.client.set_terminated(run_id, status="KILLED")
            except Exception:  # noqa: BLE001
                logger.warning("MLflow: could not end the run of trial %s", trial_id,
                               exc_info=True)
        try:
            self.client.set_terminated(self.parent_run_id, status="FAILED")
        except Exception:  # noqa: BLE001
            logger.warning("MLflow: could not mark study run %s failed", self.parent_run_id,
                           exc_info=True)


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
