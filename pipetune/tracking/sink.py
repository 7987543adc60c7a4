"""The writing end of a study's MLflow record: :class:`MlflowSink`, built and called by
a :mod:`pipetune.sidecar` host (in the recorder process by default), buffers what is
sent for each run and writes it in as few ``log_batch`` calls as MLflow's limits allow.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipetune.tracking import DEFAULT_EXPERIMENT, ensure_experiment, mlflow_client

if TYPE_CHECKING:
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

logger = logging.getLogger(__name__)


def as_metric(key: str, value: float, step: int, timestamp_ms: int) -> Metric:
    """An MLflow ``Metric`` entity, ``value`` as a float."""
    from mlflow.entities import Metric

    return Metric(key=key, value=float(value), timestamp=timestamp_ms, step=step)


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

    The study's own run is opened (:meth:`open_study`, :meth:`resume_study`) and ended
    (:meth:`finish_study`, :meth:`fail_study`) here too, so the study process never
    loads MLflow (2 s of CPU here, and the store's creation or migration).
    """

    def __init__(self, *, tags: dict[str, str], experiment_id: str | None = None,
                 parent_run_id: str | None = None, tracking_uri: str | None = None,
                 client: MlflowClient | None = None, children: dict[int, str] | None = None):
        self._client = client
        self.tracking_uri = tracking_uri
        self.experiment_id = experiment_id
        self.parent_run_id = parent_run_id
        self.tags = tags
        self._children: dict[int, str] = dict(children or {})
        self._pending: dict[Hashable, _Buffer] = {}

    @property
    def client(self) -> Any:
        """The sink's MLflow client, built on first use: building one creates (or
        migrates) a SQLite store, which must wait for :func:`ensure_experiment`'s lock
        when several commands start on one fresh store."""
        if self._client is None:
            self._client = mlflow_client(self.tracking_uri)
        return self._client

    # -- the study's run ---------------------------------------------------------------
    def experiment(self, name: str = DEFAULT_EXPERIMENT) -> str:
        """The id of ``name`` in the store, both created if need be."""
        return ensure_experiment(self._uri(), name)

    def open_study(self, experiment: str, run_name: str, tags: dict[str, str],
                   params: Sequence[tuple[str, str]],
                   files: Sequence[tuple[dict[str, Any], str]],
                   start_time: int | None = None) -> tuple[str, str]:
        """The store and ``experiment`` (created if needed), then the study's parent run
        (starting at ``start_time``, ms since the epoch; default now) with its ``params``
        and JSON ``files`` (dict, artifact file name); returns
        ``(experiment_id, parent_run_id)``."""
        from mlflow.entities import Param

        self.experiment_id = ensure_experiment(self._uri(), experiment)
        parent = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags,
                                        start_time=start_time)
        self.parent_run_id = parent.info.run_id
        self.client.log_batch(self.parent_run_id, params=[Param(k, v) for k, v in params])
        for content, name in files:
            self.client.log_dict(self.parent_run_id, content, name)
        return self.experiment_id, self.parent_run_id

    def resume_study(self, run_id: str, experiment: str = DEFAULT_EXPERIMENT,
                     ) -> tuple[str, dict[int, str]]:
        """Continue the parent run ``run_id`` (RUNNING again) and its trial runs; returns
        ``(experiment_id, {trial id: child run id})``."""
        ensure_experiment(self._uri(), experiment)
        self.parent_run_id = run_id
        self.experiment_id = self.client.get_run(run_id).info.experiment_id
        self.client.update_run(run_id, status="RUNNING")
        self._children = self.children_from_store()
        return self.experiment_id, dict(self._children)

    def reopen(self, run_ids: Sequence[str]) -> None:
        """Trial runs running again (a resumed study): a failure they ended with (the
        checkpoint store refused them) no longer stands."""
        self.idle()
        for run_id in run_ids:
            self.client.update_run(run_id, status="RUNNING")
            if "error" in self.client.get_run(run_id).data.tags:
                self.client.delete_tag(run_id, "error")

    def artifact_uri(self) -> str:
        return self.client.get_run(self.parent_run_id).info.artifact_uri

    def finish_study(self, metrics: Sequence[tuple[str, float, int, int]] = (),
                     params: Sequence[tuple[str, str]] = (),
                     tags: Sequence[tuple[str, str]] = (),
                     texts: Sequence[tuple[str, str]] = (),
                     files: Sequence[tuple[bytes, str]] = (),
                     best_model: tuple[str, dict[str, Any], str] | None = None,
                     best_trial: int | None = None, end: bool = True,
                     end_time: int | None = None) -> None:
        """Everything sent before written, then the study's summary on its parent run:
        ``texts`` (content, artifact file name), ``files`` (bytes, artifact file name),
        ``best_model`` (checkpoint reference, ``best_model.json`` record, recipe) under
        ``best_model/``, the tag ``best_trial_run_id``; with ``end``, the run ends
        FINISHED at ``end_time`` (ms since the epoch; default now)."""
        import json
        import tempfile
        from pathlib import Path

        from mlflow.entities import Param, RunTag

        self.idle()
        run_id = self.parent_run_id
        tags = list(tags)
        if best_trial is not None and best_trial in self._children:
            tags.append(("best_trial_run_id", self._children[best_trial]))
        if metrics or params or tags:
            for ms, ps, ts in batches([as_metric(*m) for m in metrics],
                                      [Param(k, v) for k, v in params],
                                      [RunTag(k, v) for k, v in tags]):
                self.client.log_batch(run_id, metrics=ms, params=ps, tags=ts)
        for content, name in texts:
            self.client.log_text(run_id, content, name)
        if files:
            with tempfile.TemporaryDirectory() as tmp:
                for content, name in files:
                    path = Path(tmp) / name
                    path.write_bytes(content)
                    self.client.log_artifact(run_id, str(path))
        if best_model is not None:
            from pipetune.checkpoints import CheckpointStore
            from pipetune.tracking.best_model import CHECKPOINT_FILE

            checkpoint, record, recipe = best_model
            with tempfile.TemporaryDirectory() as tmp:
                folder = Path(tmp)
                (folder / CHECKPOINT_FILE).write_bytes(CheckpointStore.read_bytes(checkpoint))
                (folder / "best_model.json").write_text(json.dumps(record, indent=2,
                                                                   default=str))
                (folder / "load_best_model.py").write_text(recipe)
                self.client.log_artifacts(run_id, tmp, "best_model")
        if end:
            self.client.set_terminated(run_id, status="FINISHED", end_time=end_time)

    def fail_study(self, status: str, reason: str | None = None,
                   end_time: int | None = None) -> None:
        """What was sent written as far as it can be, then every trial run still
        running ended KILLED and the parent run ended ``status`` (with ``reason`` as its
        ``pipetune.failure`` tag), all at ``end_time`` (ms since the epoch; default
        now). Never raises for one run: what cannot be written is logged; the first
        failure is raised at the end (the caller says what was lost)."""
        error: Exception | None = None
        try:
            self.idle()
        except Exception as e:  # noqa: BLE001 - the runs are still ended
            error = e
        if reason:
            try:
                self.client.set_tag(self.parent_run_id, "pipetune.failure", reason[:5000])
            except Exception as e:  # noqa: BLE001
                error = error or e
        for trial_id, run_id in sorted(self._children.items()):
            try:
                if self.client.get_run(run_id).info.status == "RUNNING":
                    self.client.set_terminated(run_id, status="KILLED", end_time=end_time)
            except Exception as e:  # noqa: BLE001
                logger.warning("MLflow: could not end the run of trial %s: %s", trial_id, e)
                error = error or e
        try:
            self.client.set_terminated(self.parent_run_id, status=status, end_time=end_time)
        except Exception as e:  # noqa: BLE001
            logger.warning("MLflow: could not mark study run %s ended: %s",
                           self.parent_run_id, e)
            error = error or e
        if error is not None:
            raise error

    def children_from_store(self) -> dict[int, str]:
        """Trial id -> run id of the parent run's trial runs, as the store has them."""
        runs = self.client.search_runs(
            [self.experiment_id], f"tags.mlflow.parentRunId = '{self.parent_run_id}'")
        return {int(r.data.tags["pipetune.trial_id"]): r.info.run_id for r in runs
                if "pipetune.trial_id" in r.data.tags}

    def _uri(self) -> str:
        return self.tracking_uri or str(self._client.tracking_uri)

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
                    [as_metric(*m) for m in buf.metrics],
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

    def create_child(self, trial_id: int, start_time: int | None = None) -> None:
        """The run of trial ``trial_id``, a child of the study's, starting at
        ``start_time`` (ms since the epoch: when the trial started; default now)."""
        self.idle()
        run = self.client.create_run(
            self.experiment_id,
            start_time=start_time,
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

    def log_text(self, run: Hashable, content: str, name: str) -> None:
        """``content`` as the artifact file ``name`` of ``run``."""
        self.idle()
        self.client.log_text(self._run_id(run), content, name)

    def terminate(self, run: Hashable, status: str, end_time: int | None = None) -> None:
        """``run`` ended ``status`` at ``end_time`` (ms since the epoch; default now)."""
        self.idle()
        self.client.set_terminated(self._run_id(run), status=status, end_time=end_time)

    def children(self) -> dict[int, str]:
        """Everything sent so far written; trial id -> child run id."""
        self.idle()
        return dict(self._children)
