"""The pipetune error family.

Every error a user can cause derives from :class:`PipetuneError`; the CLI turns
those into one clear line and exit code 2. Anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations


class PipetuneError(Exception):
    """Base of every error pipetune raises on purpose."""

    #: The command line's exit code for it: 2, a user error refused before or while
    #: starting; a subclass for a study that ran and failed says 1.
    exit_code = 2


class SpecError(PipetuneError):
    """A job spec (or a value in it) is invalid.

    ``field`` is the dotted path of the offending field, e.g. ``search.trials``.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)

    def __reduce__(self):  # survives pickling, so a worker's error reaches the driver
        return (type(self), (self.field, self.message))


class WorkloadParamError(SpecError):
    """Raise it from your workload's constructor when one of its params is wrong.

    ``field`` is the param's name under ``workload.params`` (``width``, or a dotted path
    into a nested one: ``layers.0.width``); ``message`` says what is allowed. Validation
    (``pipetune validate``, ``tune``, ...) reports it as one line and exits 2::

        raise WorkloadParamError("width", "must be > 0")
        # error: job.yaml: workload.params.width: must be > 0

    It is a :class:`SpecError` whose ``field`` is the full dotted path
    (``workload.params.width``); ``param`` keeps the name as given.
    """

    PREFIX = "workload.params."

    def __init__(self, field: str, message: str):
        self.param = str(field).removeprefix(self.PREFIX)
        super().__init__(f"{self.PREFIX}{self.param}" if self.param else "workload.params",
                         message)

    def __reduce__(self):
        return (type(self), (self.param, self.message))


class SystemConfigError(SpecError):
    """A system knob value this machine cannot honour, or that is malformed."""


class ConfinementError(SpecError):
    """A run sent through a deployment names a path outside the roots the worker allows,
    or a workload module it does not allow (:mod:`pipetune.confine`)."""


class WorkloadError(PipetuneError):
    """A workload could not be found, built or trained."""


class BrokenWorkload(WorkloadError):
    """The study stopped because its trials kept failing with the same error before any
    epoch finished: the workload's code is broken, not one trial's hyperparameters.
    The message is one line naming the workload, the exception and where its whole
    traceback is. Exit code 1: the study ran and failed."""

    exit_code = 1


class StorageError(PipetuneError):
    """A checkpoint or artifact location that cannot be used, or refused an operation."""


class CheckpointWriteError(StorageError):
    """A checkpoint store refused an epoch's checkpoint (full, over quota, read-only,
    gone): the message is one line naming the file and the OS error. The epoch fails
    with it (its result is not kept: nothing could resume from it), and when trials
    keep failing this way the study stops (``search.stop_after_failures``), resumable
    once the store has room. Exit code 1: the study ran and failed."""

    exit_code = 1


def refused_by_store(error: str | None) -> bool:
    """Whether an epoch's one-line error (``Type: message``) is the checkpoint store's
    refusal: not the trial's fault (the study counts these apart, a resume lets the
    trial go on). The one test, for the engine, its replay and the MLflow record."""
    name = CheckpointWriteError.__name__
    return error is not None and (error == name or error.startswith(f"{name}:"))


class GroundTruthError(PipetuneError):
    """The ground-truth store is unreadable or was used wrongly."""


class Stopped(KeyboardInterrupt):
    """The command was told to stop by a signal (SIGTERM, SIGHUP; SIGINT stays a plain
    ``KeyboardInterrupt``). Running epochs are cancelled, the MLflow runs end KILLED,
    and the process exits ``128 + signum``."""

    def __init__(self, signum: int):
        import signal

        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    def __reduce__(self):
        return (type(self), (self.signum,))
