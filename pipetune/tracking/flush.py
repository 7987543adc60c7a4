"""``pipetune tracking flush``: what a study left waiting in its spool (the store did not
answer), sent now, in order, each write once."""

from __future__ import annotations

from pathlib import Path

from pipetune.errors import PipetuneError
from pipetune.tracking.sink import MlflowSink
from pipetune.tracking.spool import Spool, StoreUnavailable, spool_path, store_unavailable


def send_spool(study_id: str, home: Path | None = None) -> tuple[int, str | None]:
    """Send what study ``study_id`` left in its spool, in order, each write once;
    returns ``(writes sent, tracking URI)`` (``(0, None)`` when nothing waits).

    Raises :class:`StoreUnavailable` when the store still does not answer (what was
    sent before is acknowledged; the rest waits), and what a write raised otherwise."""
    path = spool_path(study_id, home)
    if not path.parent.is_dir():
        raise PipetuneError(f"no study {study_id!r} under {path.parent.parent}")
    spool = Spool(path)
    with spool.locked():
        header, writes = spool.read()
    if not writes:
        return 0, None
    uri = header["tracking_uri"]
    sink = MlflowSink(tags=header.get("tags", {}), tracking_uri=uri,
                      experiment_id=header.get("experiment_id"),
                      parent_run_id=header.get("parent_run_id"), spool=str(path))
    try:
        sent = sink.send_waiting()
    except Exception as e:
        if store_unavailable(e):
            raise StoreUnavailable(f"MLflow at {uri} did not answer ({e}); "
                                   f"{spool.waiting()} write(s) still wait in {path}") from e
        raise
    return sent, uri
