"""Every exception pipetune defines survives pickling with its message and fields, so
one raised on a Dask worker (or in the recorder process) reaches the driver intact."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
import signal

import pytest

import pipetune
from pipetune.errors import SpecError, Stopped

#: One instance of each, built as the code builds it.
SAMPLES = {
    "PipetuneError": lambda c: c("plain message"),
    "SpecError": lambda c: c("search.trials", "must be >= 1"),
    "SystemConfigError": lambda c: c("system.cores", "must be <= 2"),
    "ConfinementError": lambda c: c("checkpoint_root", "is outside the allowed roots"),
    "WorkloadError": lambda c: c("workload broke"),
    "BrokenWorkload": lambda c: c("workload x is broken: 3 trials failed with ..."),
    "WorkloadParamError": lambda c: c("width", "must be > 0"),
    "DatasetError": lambda c: c("file missing"),
    "GroundTruthError": lambda c: c("store corrupt"),
    "StorageError": lambda c: c("PUT http://h/x.pt: HTTP 503"),
    "CheckpointWriteError": lambda c: c(
        "checkpoint store refused /ck/s/trial-001/epoch-002.pt (14025 bytes): "
        "[Errno 28] No space left on device"),
    "JournalError": lambda c: c("line 2 is corrupt"),
    "TimesError": lambda c: c("--times x: no study journal there"),
    "DataError": lambda c: c("result.phase: 'sideways' is not one of 'profile', ..."),
    "StoreUnavailable": lambda c: c("MLflow at http://127.0.0.1:5000 did not answer"),
    "TrackingUnreachable": lambda c: c("the MLflow tracking store at x does not answer", 2),
    "Stopped": lambda c: c(signal.SIGTERM),
    "StudyStuck": lambda c: c("nothing launchable"),
    "SidecarError": lambda c: c("recorder gone"),
    "EpochFailed": lambda c: c("worker died: ..."),
    "ClusterStartError": lambda c: c("the embedded Dask cluster did not start"),
    "WriterError": lambda c: c("trial 3 has no MLflow run"),
    "OptunaRunFailed": lambda c: c(1, "Traceback ...\nRuntimeError: boom"),
    "RayTuneRunFailed": lambda c: c(1, "Traceback ...\nRuntimeError: boom"),
    "PeerRunFailed": lambda c: c(1, "Traceback ...\nRuntimeError: boom"),
    "RayTuneUnavailable": lambda c: c("ray-tune: skipped (Ray Tune is not installed)"),
}


def defined_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(pipetune.__path__, "pipetune."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__ == module.__name__):
                found[name] = obj
    return found


def test_every_exception_is_covered():
    assert set(defined_exceptions()) == set(SAMPLES)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_round_trips(name):
    cls = defined_exceptions()[name]
    exc = SAMPLES[name](cls)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls and str(back) == str(exc)
    assert vars(back) == vars(exc)  # field, message, signum ... kept
    if isinstance(exc, SpecError):
        assert back.field == exc.field
    if name == "WorkloadParamError":
        assert (back.field, back.param) == ("workload.params.width", "width")
    if isinstance(exc, Stopped):
        assert back.signum == signal.SIGTERM
