"""The MLflow store of a study: its URI, the experiment (created under a file lock for
SQLite: several processes creating one fresh SQLite store at once fail), and a client
that rides out a locked SQLite store (its back-off, :data:`LOCKED_BACKOFF_S`, is read
here at each retry). Re-exported by :mod:`pipetune.tracking`."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Experiment every study is filed under unless the caller names another.
DEFAULT_EXPERIMENT = "pipetune"


def _artifact_root(tracking_uri: str) -> str | None:
    """Artifacts of a SQLite store go beside the database file, not into the cwd."""
    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri[len("sqlite:///"):])
        return (db.parent / "mlartifacts").resolve().as_uri()
    return None


#: The experiment tag that says an experiment's kind, and the value (MLflow's front end's
#: ``ExperimentKind``) for "Model training". Set unless one is set already. MLflow 3.17's
#: UI takes the kind from its GenAI / Model training switch (the link's ``workflowType``,
#: else the browser's last choice) and reads the tag only with that switch off.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


def ensure_experiment(tracking_uri: str, name: str = DEFAULT_EXPERIMENT) -> str:
    """Create the store and the experiment if needed; return the experiment id.

    For a SQLite store this holds a file lock beside the database while MLflow creates
    or migrates its schema: two commands starting at once on a fresh store both failed
    there (``table _alembic_tmp_... already exists``)."""

    from mlflow.exceptions import MlflowException

    with _store_lock(tracking_uri):
        client = mlflow_client(tracking_uri)
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            if EXPERIMENT_KIND_TAG not in experiment.tags:  # made by an older pipetune
                client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG,
                                          EXPERIMENT_KIND)
            return experiment.experiment_id
        try:
            return client.create_experiment(name,
                                            artifact_location=_artifact_root(tracking_uri),
                                            tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        except MlflowException as e:
            # Another study on the same tracking server created it meanwhile (the file
            # lock above guards only a SQLite store on this machine).
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return experiment.experiment_id


def ensure_experiment_in_recorder(tracking_uri: str, name: str = DEFAULT_EXPERIMENT) -> str:
    """:func:`ensure_experiment` done by this process's recorder process
    (:func:`pipetune.sidecar.shared_host`, started if need be), which writes the study's
    MLflow record anyway: the store's creation or migration and MLflow's imports (2-3 s
    of CPU here) stay out of this process. Raises what it raised."""
    from pipetune.sidecar import shared_host

    channel = shared_host().attach(
        "pipetune.tracking.sink:MlflowSink", "mlflow-store", tracking_uri=tracking_uri, tags={})
    try:
        return channel.call("experiment", name)
    finally:
        channel.close()


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
