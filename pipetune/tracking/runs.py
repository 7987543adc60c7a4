"""A study's runs in one MLflow store, and each write to them as it lands: the parent
run, its trial runs (a child run per trial), metrics, tags, artifacts and ends.

:class:`~pipetune.tracking.sink.MlflowSink` decides *when* a write goes (buffered,
in order, or waiting in a spool while the store does not answer); :class:`StudyRuns`
is *what* it does to the store. Every write takes ``unsure``: the same write may have
landed before its call failed (a timeout, a server stopped mid-call), so it checks
what the store holds first and never writes a metric or creates a run twice.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import posixpath
import tempfile
from collections.abc import Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pipetune.tracking.store import mlflow_client

if TYPE_CHECKING:
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

logger = logging.getLogger(__name__)


class WriterError(RuntimeError):
    """The background MLflow writer cannot finish what was queued (it died or timed out)."""


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


class StudyRuns:
    """The runs of one study in the store at ``tracking_uri`` (or ``client``'s): the
    ``experiment_id``, the parent run ``parent_run_id`` and ``children`` (trial id ->
    run id); ``tags`` go on every trial run created. A run is a run id, or
    ``("trial", trial_id)`` for a trial's run."""

    def __init__(self, *, tags: dict[str, str], experiment_id: str | None = None,
                 parent_run_id: str | None = None, tracking_uri: str | None = None,
                 client: MlflowClient | None = None, children: dict[int, str] | None = None):
        self._client = client
        self.tracking_uri = tracking_uri
        self.experiment_id = experiment_id
        self.parent_run_id = parent_run_id
        self.tags = tags
        self.children: dict[int, str] = dict(children or {})
        #: Run id -> artifact location, for the trial runs this process created and has
        #: not ended: an artifact goes there without asking the store for the run.
        self._artifacts: dict[str, str] = {}

    @property
    def client(self) -> Any:
        """The MLflow client, built on first use: building one creates (or migrates) a
        SQLite store, which must wait for the lock of
        :func:`~pipetune.tracking.store.ensure_experiment` when several commands start on
        one fresh store."""
        if self._client is None:
            self._client = mlflow_client(self.tracking_uri)
        return self._client

    def uri(self) -> str:
        return self.tracking_uri or str(self._client.tracking_uri)

    def children_from_store(self) -> dict[int, str]:
        """Trial id -> run id of the parent run's trial runs, as the store has them."""
        runs = self.client.search_runs(
            [self.experiment_id], f"tags.mlflow.parentRunId = '{self.parent_run_id}'")
        return {int(r.data.tags["pipetune.trial_id"]): r.info.run_id for r in runs
                if "pipetune.trial_id" in r.data.tags}

    def run_id(self, run: Hashable) -> str:
        if isinstance(run, tuple):
            try:
                return self.children[run[1]]
            except KeyError:
                raise WriterError(f"trial {run[1]} has no MLflow run (creating it failed)") \
                    from None
        return str(run)

    def _unsent(self, run_id: str, metrics: Sequence[Sequence[Any]]) -> list[Sequence[Any]]:
        """``metrics`` less those already in ``run_id``'s history (same key, step,
        timestamp and value): a write that may have landed before its call failed."""
        have: set[tuple[str, int, int, float]] = set()
        for key in sorted({m[0] for m in metrics}):
            for h in self.client.get_metric_history(run_id, key):
                have.add((key, int(h.step), int(h.timestamp), _same(h.value)))
        out = [m for m in metrics if (m[0], int(m[2]), int(m[3]), _same(m[1])) not in have]
        if len(out) < len(metrics):
            logger.info("MLflow: %d metric(s) of run %s were in already; not sent again",
                        len(metrics) - len(out), run_id)
        return out

    def create_child(self, trial_id: int, start_time: int | None,
                     tags: Sequence[Sequence[str]] = (), *, unsure: bool) -> None:
        """The trial's run, with ``tags`` beside the study's: set in the same call (and
        transaction) as the run's creation, where ``log_batch`` would be a second one."""
        if unsure and trial_id not in self.children:  # created before its call failed?
            self.children.update(self.children_from_store())
        if trial_id in self.children:  # its tags go on it anyway (setting one is idempotent)
            if tags:
                self.log_batch(("trial", trial_id), (), (), tags, unsure=False)
            return
        run = self.client.create_run(
            self.experiment_id,
            start_time=start_time,
            run_name=f"trial-{trial_id}",
            tags={
                **self.tags,
                **dict(tags),
                "mlflow.parentRunId": self.parent_run_id,
                "pipetune.kind": "trial",
                "pipetune.trial_id": str(trial_id),
            },
        )
        self.children[trial_id] = run.info.run_id
        self._artifacts[run.info.run_id] = run.info.artifact_uri

    def log_batch(self, run: Hashable, metrics: Sequence[Sequence[Any]],
                  params: Sequence[Sequence[str]], tags: Sequence[Sequence[str]], *,
                  unsure: bool) -> None:
        from mlflow.entities import Param, RunTag

        run_id = self.run_id(run)
        if unsure:
            metrics = self._unsent(run_id, metrics)
        for ms, ps, ts in batches([as_metric(*m) for m in metrics],
                                  [Param(k, v) for k, v in params],
                                  [RunTag(k, v) for k, v in tags]):
            self.client.log_batch(run_id, metrics=ms, params=ps, tags=ts)

    def log_text(self, run: Hashable, content: str, name: str, *, unsure: bool) -> None:
        """``content`` as the artifact file ``name``; straight to the run's artifact
        location when this process created the run (MLflow's ``log_text`` first reads
        the whole run from the store to find it: a third of the write's cost)."""
        run_id = self.run_id(run)
        location = self._artifacts.get(run_id)
        if location is None:
            self.client.log_text(run_id, content, name)
            return
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        repo = get_artifact_repository(location, tracking_uri=self.uri())
        folder, base = posixpath.split(posixpath.normpath(name))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, base)
            with open(path, "w", encoding="utf-8") as f:
                f.write(content)
            repo.log_artifact(path, folder or None)

    def terminate(self, run: Hashable, status: str, end_time: int | None, *,
                  unsure: bool) -> None:
        run_id = self.run_id(run)
        self.client.set_terminated(run_id, status=status, end_time=end_time)
        self._artifacts.pop(run_id, None)

    def reopen(self, run_ids: Sequence[str], *, unsure: bool) -> None:
        for run_id in run_ids:
            self.client.update_run(run_id, status="RUNNING")
            if "error" in self.client.get_run(run_id).data.tags:
                self.client.delete_tag(run_id, "error")

    def finish_study(self, metrics: Sequence[Sequence[Any]],
                     params: Sequence[Sequence[str]], tags: Sequence[Sequence[str]],
                     texts: Sequence[Sequence[str]], files: Sequence[Sequence[Any]],
                     best_model: Sequence[Any] | None, best_trial: int | None,
                     end: bool, end_time: int | None, *, unsure: bool) -> None:
        import json
        import tempfile
        from pathlib import Path

        from mlflow.entities import Param, RunTag

        run_id = self.parent_run_id
        tags = [tuple(t) for t in tags]
        if best_trial is not None and best_trial in self.children:
            tags.append(("best_trial_run_id", self.children[best_trial]))
        if unsure:
            metrics = self._unsent(run_id, metrics)
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

    def fail_study(self, status: str, reason: str | None, end_time: int | None, *,
                   unsure: bool) -> None:
        error: Exception | None = None
        if reason:
            try:
                self.client.set_tag(self.parent_run_id, "pipetune.failure", reason[:5000])
            except Exception as e:  # noqa: BLE001
                error = error or e
        if unsure or not self.children:
            with contextlib.suppress(Exception):
                self.children.update(self.children_from_store())
        for trial_id, run_id in sorted(self.children.items()):
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


def _same(value: float) -> float | str:
    """A metric value as compared with the store's (NaN equal to NaN)."""
    value = float(value)
    return "nan" if math.isnan(value) else value
