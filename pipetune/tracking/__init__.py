"""MLflow record of a study: one parent run, one child run per trial.

Only the process that owns the study loop writes here; workers return results. The
tracking store and the experiment are created once, before any fan-out (several
processes creating one fresh SQLite store at once fail).

Per-trial writes (child runs, epoch metrics, trial outcomes) go to an
:class:`MlflowSink` in a recorder process (:mod:`pipetune.sidecar`), so the study loop
never waits on the tracking store nor shares its GIL with SQLAlchemy: the sink merges
what was sent for a run into batched ``log_batch`` calls. :meth:`StudyTracker.flush`
waits for everything sent so far.

One module per reason to change:

===================  =================================================================
``api``              :class:`Tracker`, the interface a study's record implements (an
                     observer of the engine's events, then the study's end); the job
                     file's ``tracking.trackers`` adds trackers of your own
``store``            the store: its URI, the experiment (created under a file lock for
                     SQLite), a client that rides out a locked SQLite store (its
                     back-off, ``LOCKED_BACKOFF_S``, is read there at each retry)
``sink``             the writing end, in the recorder process: ``log_batch`` limits,
                     buffering and batching (:class:`MlflowSink`); what the store did
                     not answer sent later (:func:`send_spool`)
``spool``            where writes wait while the store does not answer: the study's
                     JSON-lines spool file, what counts as "does not answer"
``tracker``          the study's view: parent and child runs, what an epoch, a trial
                     and the study write (:class:`StudyTracker`)
===================  =================================================================

The names below are re-exported here; import them from :mod:`pipetune.tracking`.
"""

from __future__ import annotations

from pipetune.home import default_tracking_uri
from pipetune.tracking.api import Tracker
from pipetune.tracking.flush import send_spool
from pipetune.tracking.runs import (
    MAX_ENTITIES_PER_BATCH,
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_PER_BATCH,
    MAX_TAGS_PER_BATCH,
    WriterError,
    batches,
)
from pipetune.tracking.sink import MlflowSink
from pipetune.tracking.spool import (
    SpoolNote,
    StoreUnavailable,
    TrackingUnreachable,
)
from pipetune.tracking.store import (
    DEFAULT_EXPERIMENT,
    LOCKED_BACKOFF_S,
    RetryingClient,
    ensure_experiment,
    ensure_experiment_in_recorder,
    mlflow_client,
)
from pipetune.tracking.tracker import StudyTracker, profile_rows

__all__ = [
    "DEFAULT_EXPERIMENT",
    "LOCKED_BACKOFF_S",
    "MAX_ENTITIES_PER_BATCH",
    "MAX_METRICS_PER_BATCH",
    "MAX_PARAMS_PER_BATCH",
    "MAX_TAGS_PER_BATCH",
    "MlflowSink",
    "RetryingClient",
    "SpoolNote",
    "StoreUnavailable",
    "StudyTracker",
    "Tracker",
    "TrackingUnreachable",
    "WriterError",
    "batches",
    "default_tracking_uri",
    "ensure_experiment",
    "ensure_experiment_in_recorder",
    "mlflow_client",
    "profile_rows",
    "send_spool",
]
