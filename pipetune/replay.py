"""Resuming a study: its journal's events replayed into a fresh engine.

:meth:`pipetune.study.Study.replay` is the public entry; this module holds the how.
The events are fed to the engine's own methods, in the same order, so the searcher
is asked and told, the scheduler sees each result, and each trial gets its match and
decisions exactly as before; the engine's ``_replaying`` flag keeps them out of the
journal and the ground truth a second time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from pipetune.journal import JournalError

if TYPE_CHECKING:
    from pipetune.journal import Event
    from pipetune.study import Study


def replay(study: Study, events: list[Event], checkpoint_exists: Callable[[str], bool]) -> int:
    """Bring the fresh engine ``study`` to where the journal's study stopped; return the
    number of finished epochs taken over (they are not run again).

    What was running when the study stopped is queued again: a trial's interrupted
    epoch restarts from its last checkpoint. A running trial whose newest checkpoints
    never reached storage (their write was still in the background) gives those epochs
    back: they run again.
    """
    if study.trials:
        raise JournalError("replay needs a fresh study")
    keep = replayable(events, checkpoint_exists)
    study._replaying = True
    try:
        for event in events:
            if not keep(event):
                continue
            if event.kind == "start":
                task = study._start_trial()
                trial = study.trials.get(event.trial)
                if task is None or trial is None or trial.params != event.data:
                    raise JournalError(
                        f"study {study.study_id}: the searcher no longer proposes trial "
                        f"{event.trial} with {event.data} (was the job changed?)")
                study._queue.append(task)
            elif event.kind == "result":
                _unqueue(study, event.trial, event.data.epoch)
                study.on_epoch_done(event.data)
                study.resumed_epochs += 1
            elif event.kind == "failed":  # (epoch, error[, traceback file]): older have 2
                epoch, error, *kept = event.data
                _unqueue(study, event.trial, epoch)
                study.on_epoch_failed(event.trial, epoch, error,
                                      traceback_file=kept[0] if kept else None)
            elif event.kind == "match":
                study.set_match(event.trial, event.data)
            elif event.kind == "decision":
                study.apply_decision(event.trial, event.data)
    finally:
        study._replaying = False
    return study.resumed_epochs


def _unqueue(study: Study, trial_id: int, epoch: int) -> None:
    study._queue = deque(t for t in study._queue if (t.trial_id, t.epoch) != (trial_id, epoch))


def replayable(
    events: list[Event], checkpoint_exists: Callable[[str], bool]
) -> Callable[[Event], bool]:
    """Which events to replay: all but, for each trial the journal leaves running,
    its results past the last one whose checkpoint is on storage (and the match and
    decisions that followed them)."""
    ended = {e.trial for e in events if e.kind == "failed"}
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
