"""Resuming a study: which of its journal's events to replay.

:meth:`pipetune.engine.study.Study.replay` feeds them to a fresh engine; this module decides,
from the events alone and what storage holds, which of them still stand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pipetune.errors import refused_by_store

if TYPE_CHECKING:
    from pipetune.engine.journal import Event


def store_refused(event: Event) -> bool:
    """Whether ``event`` is a trial's failure because the checkpoint store refused its
    checkpoint (:class:`~pipetune.errors.CheckpointWriteError`: full, read-only), not
    its own fault: a resumed study lets the trial go on from its last checkpoint."""
    return event.kind == "failed" and refused_by_store(event.data[1])


def replayable(
    events: list[Event], checkpoint_exists: Callable[[str], bool]
) -> Callable[[Event], bool]:
    """Which events to replay: all but, for each trial the journal leaves running (or
    failed only because the store refused its checkpoint), its results past the last
    one whose checkpoint is on storage (and the match and decisions that followed)."""
    ended = {e.trial for e in events if e.kind == "failed" and not store_refused(e)}
    results: dict[int, list[Event]] = {}
    for e in events:
        if e.kind == "result":
            results.setdefault(e.trial, []).append(e)
    cut: dict[int, int] = {}  # trial -> seq of the first event dropped
    for trial, rs in results.items():
        if trial in ended:
            continue
        good = len(rs)
        while good and not checkpoint_exists(rs[good - 1].data.checkpoint):
            good -= 1
        if good < len(rs):
            cut[trial] = rs[good].seq
    return lambda e: e.trial not in cut or e.seq < cut[e.trial] or e.kind == "start"
