"""MLflow record of a study: one parent run, one child run per trial.

Only the process that owns the study loop writes here; workers return results. The
tracking store and the experiment are created once, before any fan-out (several
processes creating one fresh SQLite store at once fail).

Per-trial writes (child runs, epoch metrics, trial outcomes) go to an
:class:`MlflowSink` in a recorder process (:mod:`pipetune.sidecar`), so the study loop
never waits on the tracking store nor shares its GIL with SQLAlchemy: the sink merges
what was sent for a run into batched ``log_batch`` calls. :meth:`StudyTracker.flush`
waits for everything sent so far.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import tempfile
import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipetune.states import TrialState

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
    """Create the store and the experiment if needed; return the experiment id.

    For a SQLite store this holds a file lock beside the database while MLflow creates
    or migrates its schema: two commands starting at once on a fresh store both failed
    there (``table _alembic_tmp_... already exists``)."""

    with _store_lock(tracking_uri):
        client = mlflow_client(tracking_uri)
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        return client.create_experiment(name, artifact_location=_artifact_root(tracking_uri))


@contextlib.contextmanager
def _store_lock(tracking_uri: str) -> Iterator[None]:
    if not tracking_uri.startswith("sqlite:///"):
        yield  # a tracking server serialises its own schema
        return
    import fcntl

    db = Path(tracking_uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _metric(key: str, value: float, step: int, timestamp_ms: int):
    from mlflow.entities import Metric

    return Metric(key=key, value=float(value), timestamp=timestamp_ms, step=step)


logger = logging.getLogger(__name__)

#: Back-off (seconds) between tries of an MLflow call SQLite refused as locked, after
#: its own 5 s busy wait: many studies writing one SQLite store at once.
LOCKED_BACKOFF_S = (0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)


class RetryingClient:
    """An ``MlflowClient`` whose calls are tried again, with back-off, while SQLite
    answers ``database is locked`` (a refused SQLite transaction is rolled back
    whole, so a second try never writes twice); any other error is raised at once."""

    def __init__(self, client: Any):
        self._client = client

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            for delay in (*LOCKED_BACKOFF_S, None):
                try:
                    return attr(*args, **kwargs)
                except Exception as e:
                    if delay is None or "database is locked" not in str(e):
                        raise
                    logger.info("MLflow store locked (%s); trying again in %.1f s", name, delay)
                    time.sleep(delay)
            raise AssertionError("unreachable")

        return call


def mlflow_client(tracking_uri: str | None) -> RetryingClient:
    """An MLflow client on ``tracking_uri`` that rides out a locked SQLite store."""
    from mlflow.tracking import MlflowClient

    return RetryingClient(MlflowClient(tracking_uri))

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
class _Buffer:
    """What is queued for one run: metrics in order, params and tags by key (last wins,
    as writing them one after the other would leave them)."""

    metrics: list[tuple[str, float, int, int]] = field(default_factory=list)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)


class WriterError(RuntimeError):
    """The background MLflow writer cannot finish what was queued (it died or timed out)."""


class MlflowSink:
    """The writing end of a :class:`StudyTracker`, run by a :mod:`pipetune.sidecar`
    host (a child process by default, a thread when the tracker is given a client).

    Metrics, params and tags sent for a run with :meth:`log` are buffered and merged
    into as few ``log_batch`` calls as MLflow's limits allow when the host is idle or
    before any other write (so the order things were sent in is the order they land).
    A run is a run id, or ``("trial", trial_id)`` for a child run this sink created.
    """

    def __init__(self, *, experiment_id: str, parent_run_id: str, tags: dict[str, str],
                 tracking_uri: str | None = None, client: MlflowClient | None = None,
                 children: dict[int, str] | None = None):
        self.client = client if client is not None else mlflow_client(tracking_uri)
        self.experiment_id = experiment_id
        self.parent_run_id = parent_run_id
        self.tags = tags
        self._children: dict[int, str] = dict(children or {})
        self._pending: dict[Hashable, _Buffer] = {}

    def _run_id(self, run: Hashable) -> str:
        if isinstance(run, tuple):
            try:
                return self._children[run[1]]
            except KeyError:
                raise WriterError(f"trial {run[1]} has no MLflow run (creating it failed)") \
                    from None
        return str(run)

    def log(self, run: Hashable, metrics: Sequence[tuple[str, float, int, int]] = (),
            params: Sequence[tuple[str, str]] = (), tags: Sequence[tuple[str, str]] = ()) -> None:
        buf = self._pending.setdefault(run, _Buffer())
        buf.metrics.extend(metrics)
        buf.params.update(params)
        buf.tags.update(tags)

    def idle(self) -> None:
        """Write everything buffered; raise the first failure after trying every run."""
        from mlflow.entities import Param, RunTag

        pending, self._pending = self._pending, {}
        error: Exception | None = None
        for run, buf in pending.items():
            try:
                run_id = self._run_id(run)
                for metrics, params, tags in batches(
                    [_metric(*m) for m in buf.metrics],
                    [Param(k, v) for k, v in buf.params.items()],
                    [RunTag(k, v) for k, v in buf.tags.items()],
                ):
                    self.client.log_batch(run_id, metrics=metrics, params=params, tags=tags)
            except Exception as e:  # noqa: BLE001 - the other runs are still written
                if error is None:
                    error = e
                else:
                    logger.warning("MLflow write failed too: %s: %s", type(e).__name__, e)
        if error is not None:
            raise error

    def create_child(self, trial_id: int) -> None:
        self.idle()
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

    def log_profiles(self, run: Hashable, rows: list[dict[str, Any]]) -> None:
        import pandas as pd

        self.idle()
        self.client.log_text(self._run_id(run), pd.DataFrame(rows).to_csv(index=False),
                             "profiles.csv")

    def terminate(self, run: Hashable, status: str) -> None:
        self.idle()
        self.client.set_terminated(self._run_id(run), status=status)

    def children(self) -> dict[int, str]:
        """Everything sent so far written; trial id -> child run id."""
        self.idle()
        return dict(self._children)


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
                "pipetune.tracking:MlflowSink", "mlflow", tracking_uri=tracking_uri, **where)

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
        self.client.set_terminated(self.parent_run_id, status="FINISHED")
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
