"""Opening a study: the one way in, for every caller.

:func:`open_study` takes a checked job and the options a caller was given and does
everything before the first epoch, refusing what cannot run before anything is
recorded: the resume (the journal's job, stores and MLflow runs), the ground truth's
check, the cluster's fit (space values no worker can run dropped, with a warning
each), the workload made loadable on the workers, the journal, the MLflow record, the
checkpoint store, the engine (replayed on a resume). It returns an
:class:`OpenedStudy`, whose :meth:`~OpenedStudy.run` drives the engine to the end over
a backend and returns the summary (the trials table included), recording a failure or a
stop on the way out.

The Prefect flow (:mod:`flows.study`) is wiring around it: it confines a deployment's
parameters, names its flow run, links the MLflow run and records the engine's epochs
and decisions as task runs. Nothing here imports Prefect.
"""

from __future__ import annotations

from pipetune.session.opened import OpenedStudy, evaluate_best
from pipetune.session.opening import StudyOptions, check_study, open_study
from pipetune.watching import (
    NOTICE,
    NOTICE_ATTR,
    SAID,
    SAID_ATTR,
    collecting_opened,
    observing,
)

__all__ = ["NOTICE", "NOTICE_ATTR", "SAID", "SAID_ATTR", "OpenedStudy", "StudyOptions",
           "check_study", "collecting_opened", "evaluate_best", "observing", "open_study"]
