"""The writing end of a study's MLflow record: :class:`MlflowSink`, built and called by
a :mod:`pipetune.sidecar` host (in the recorder process by default), buffers what is
sent for each run and writes it in as few ``log_batch`` calls as MLflow's limits allow.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipetune.tracking import mlflow_client

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
