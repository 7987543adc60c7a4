"""Many studies writing one SQLite MLflow store: a write SQLite refuses as locked
(past MLflow's own 20 s busy wait, or at once when two transactions would deadlock)
is tried again with back-off, and nothing is written twice; other errors are not
retried."""

from __future__ import annotations

import sqlite3

import pytest
from mlflow.tracking import MlflowClient


class LockedClient(MlflowClient):
    """The real client, except that its first ``refusals`` metric writes meet a locked
    SQLite store, as SQLAlchemy reports it."""

    def __init__(self, uri: str, refusals: int, error: str = "database is locked"):
        super().__init__(uri)
        self.refusals, self.error, self.calls = refusals, error, 0

    def log_metric(self, *args, **kwargs):
        from sqlalchemy.exc import OperationalError

        self.calls += 1
        if self.calls <= self.refusals:
            raise OperationalError("INSERT INTO metrics ...", {},
                                   sqlite3.OperationalError(self.error))
        return super().log_metric(*args, **kwargs)


@pytest.fixture
def store(tmp_path):
    from pipetune.tracking import ensure_experiment

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = MlflowClient(uri).create_run(ensure_experiment(uri))
    return uri, run.info.run_id


def test_a_locked_write_is_tried_again_and_lands_once(store):
    from pipetune.tracking import RetryingClient

    uri, run_id = store
    locked = LockedClient(uri, refusals=3)
    RetryingClient(locked).log_metric(run_id, "kept", 1.0, step=1)
    assert locked.calls == 4
    history = MlflowClient(uri).get_metric_history(run_id, "kept")
    assert [(m.value, m.step) for m in history] == [(1.0, 1)]


def test_a_store_locked_for_good_fails_after_the_back_off(store, monkeypatch):
    import pipetune.tracking as tracking

    monkeypatch.setattr(tracking.store, "LOCKED_BACKOFF_S", (0.01, 0.01))
    uri, run_id = store
    locked = LockedClient(uri, refusals=99)
    with pytest.raises(Exception, match="database is locked"):
        tracking.RetryingClient(locked).log_metric(run_id, "lost", 1.0, step=1)
    assert locked.calls == 3  # the first try and one per back-off step


def test_other_errors_are_not_retried(store):
    from pipetune.tracking import RetryingClient

    uri, run_id = store
    broken = LockedClient(uri, refusals=1, error="no such table: metrics")
    with pytest.raises(Exception, match="no such table"):
        RetryingClient(broken).log_metric(run_id, "m", 1.0)
    assert broken.calls == 1


class LockedBatches(MlflowClient):
    """The real client, except that ``log_batch`` meets a locked SQLite store while
    ``locked`` is set."""

    def __init__(self, uri: str):
        super().__init__(uri)
        self.locked, self.refused = False, 0

    def log_batch(self, *args, **kwargs):
        from sqlalchemy.exc import OperationalError

        if self.locked:
            self.refused += 1
            raise OperationalError("INSERT INTO metrics ...", {},
                                   sqlite3.OperationalError("database is locked"))
        return super().log_batch(*args, **kwargs)


def test_a_store_locked_past_the_back_off_keeps_the_writes_in_the_spool(tmp_path, monkeypatch):
    """Past the back-off a write is not lost: it and those after it wait in the spool,
    and are written, in order and once, when the store takes writes again."""
    import pipetune.tracking as tracking
    from pipetune.tracking import MlflowSink, RetryingClient
    from pipetune.tracking.spool import Spool

    monkeypatch.setattr(tracking.store, "LOCKED_BACKOFF_S", (0.01,))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    store = LockedBatches(uri)
    spool = tmp_path / "study" / "mlflow-spool.jsonl"
    sink = MlflowSink(client=RetryingClient(store), tracking_uri=uri, spool=str(spool),
                      tags={"pipetune.study_id": "locked"})
    _, parent = sink.open_study("pipetune", "locked", {}, [], [])
    sink.create_child(0)
    store.locked = True
    for epoch in (1, 2, 3):
        sink.log(("trial", 0), [("loss", 1.0 / epoch, epoch, 1000 + epoch)])
        sink.idle()  # never raises: the write waits
    sink.terminate(("trial", 0), "FINISHED", 2000)
    assert store.refused == 2  # the first write and its one retry; the rest queued behind
    assert Spool(spool).waiting() == 4
    assert sink.waiting().count == 4 and "pipetune tracking flush locked" in sink.waiting().line()
    store.locked = False
    assert sink.finish_study(end=True) is None  # sent first, then the summary
    assert not spool.exists()
    client = MlflowClient(uri)
    child = sink.children()[0]
    history = client.get_metric_history(child, "loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    assert client.get_run(child).info.status == "FINISHED"
    assert client.get_run(child).info.end_time == 2000
    assert client.get_run(parent).info.status == "FINISHED"
