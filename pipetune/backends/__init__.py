"""Executors of epoch tasks behind one small interface (Syne Tune's ``TrialBackend``).

The study engine (:meth:`pipetune.engine.study.Study.step`) hands a backend the epochs to
run and asks it for the next finished one; it decides everything else.
"""

from pipetune.backends._local import LocalBackend
from pipetune.backends.base import EpochBackend, EpochOutcome

__all__ = ["DaskBackend", "EpochBackend", "EpochOutcome", "LocalBackend"]


def __getattr__(name: str):
    if name == "DaskBackend":  # imports distributed: only when asked for
        from pipetune.dask.backend import DaskBackend

        return DaskBackend
    raise AttributeError(name)
