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

    monkeypatch.setattr(tracking, "LOCKED_BACKOFF_S", (0.01, 0.01))
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
