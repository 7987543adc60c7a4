"""The writing end of a study's MLflow record: :class:`MlflowSink`, built and called by
a :mod:`pipetune.sidecar` host (in the recorder process by default), buffers what is
sent for each run and writes it in as few ``log_batch`` calls as MLflow's limits allow.
Given a spool (:mod:`pipetune.tracking.spool`), what the store does not answer waits
there and is sent, in order and once, when it answers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipetune.tracking.runs import MAX_TAGS_PER_BATCH, StudyRuns, WriterError
from pipetune.tracking.spool import (
    START_WAIT_ENV,
    SUMMARY_TIMEOUT_S,
    Spool,
    SpoolNote,
    StoreUnavailable,
    TrackingUnreachable,
    from_json,
    quick_requests,
    short_error,
    store_unavailable,
    timed_out,
)
from pipetune.tracking.store import DEFAULT_EXPERIMENT, ensure_experiment

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

logger = logging.getLogger(__name__)


#: Seconds between tries to send what waits in a spool while the store does not answer.
RETRY_S = 3.0
#: Seconds to wait, once a store whose calls timed out answers again, before checking
#: what landed: a request it had taken in while stopped (SIGSTOP, a frozen VM) is
#: carried out as it runs again.
SETTLE_S = 1.0


@dataclass
class _Buffer:
    """What is queued for one run: metrics in order, params and tags by key (last wins,
    as writing them one after the other would leave them)."""

    metrics: list[tuple[str, float, int, int]] = field(default_factory=list)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    #: A trial run to create before the rest is written: (trial id, start time).
    create: tuple[int, int | None] | None = None


def _runs_attribute(name: str) -> property:
    """An attribute of the sink's :class:`StudyRuns`, read and set through the sink."""
    return property(lambda self: getattr(self.runs, name),
                    lambda self, value: setattr(self.runs, name, value))


class MlflowSink:
    """The writing end of a :class:`StudyTracker`, run by a :mod:`pipetune.sidecar`
    host (a child process by default, a thread when the tracker is given a client).

    Metrics, params and tags sent for a run with :meth:`log` are buffered and merged
    into as few ``log_batch`` calls as MLflow's limits allow when the host is idle or
    before any other write (so the order things were sent in is the order they land).
    A run is a run id, or ``("trial", trial_id)`` for a child run this sink created.

    The study's own run is opened (:meth:`open_study`, :meth:`resume_study`) and ended
    (:meth:`finish_study`, :meth:`fail_study`) here too, so the study process never
    loads MLflow (2 s of CPU here, and the store's creation or migration).

    With ``spool`` (a file path, :mod:`pipetune.tracking.spool`), a write the store
    does not answer (down, unreachable, locked past the back-off) and every write after
    it wait in that file; they are sent in order, each once, when the store answers
    (tried every :data:`RETRY_S` as writes come, and at the study's end).
    """

    def __init__(self, *, tags: dict[str, str], experiment_id: str | None = None,
                 parent_run_id: str | None = None, tracking_uri: str | None = None,
                 client: MlflowClient | None = None, children: dict[int, str] | None = None,
                 spool: str | None = None):
        #: What each write does to the store; this sink decides when it goes.
        self.runs = StudyRuns(tags=tags, experiment_id=experiment_id,
                              parent_run_id=parent_run_id, tracking_uri=tracking_uri,
                              client=client, children=children)
        self._pending: dict[Hashable, _Buffer] = {}
        self._spool = Spool(spool) if spool else None
        #: Writes wait in the spool: every new one goes behind them.
        self._spooling = self._spool is not None and self._spool.waiting() > 0
        self._next_try = 0.0
        self._unavailable: Exception | None = None
        #: The first waiting write the store refused (dropped), raised by ``idle``.
        self._refused: Exception | None = None
        #: Why the study's run could not be opened: no write of the study can land.
        self._open_error: Exception | None = None

    @property
    def client(self) -> Any:
        """The MLflow client (:attr:`StudyRuns.client`)."""
        return self.runs.client

    tracking_uri = property(lambda self: self.runs.tracking_uri)
    experiment_id = _runs_attribute("experiment_id")
    parent_run_id = _runs_attribute("parent_run_id")
    tags = _runs_attribute("tags")
    _children = _runs_attribute("children")

    # -- the study's run ---------------------------------------------------------------
    def experiment(self, name: str = DEFAULT_EXPERIMENT) -> str:
        """The id of ``name`` in the store, both created if need be. A store that does
        not answer (a tracking server down or restarting, a SQLite file locked) is
        tried every 2 s for up to ``$PIPETUNE_MLFLOW_START_WAIT_S`` (default 30 s),
        then :class:`TrackingUnreachable`: a study cannot go on without its run."""
        uri = self._uri()
        raw = os.environ.get(START_WAIT_ENV) or "30"
        try:
            wait_s = max(0.0, float(raw))
        except ValueError:
            raise TrackingUnreachable(f"{START_WAIT_ENV} must be a number of seconds, got "
                                      f"{raw!r}", exit_code=2) from None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                with quick_requests():
                    return ensure_experiment(uri, name)
            except Exception as e:
                if not store_unavailable(e):
                    raise
                if time.monotonic() >= deadline:
                    raise TrackingUnreachable(
                        f"the MLflow tracking store at {uri} does not answer after "
                        f"{wait_s:.0f} s ({short_error(e)}): the study cannot open its MLflow "
                        "run. Start the tracking server (or check its address), or give "
                        "another --tracking-uri") from None
                time.sleep(2)

    def open_study(self, experiment: str, run_name: str, tags: dict[str, str],
                   params: Sequence[tuple[str, str]],
                   files: Sequence[tuple[dict[str, Any], str]],
                   start_time: int | None = None) -> tuple[str, str]:
        """The store and ``experiment`` (created if needed), then the study's parent run
        (starting at ``start_time``, ms since the epoch; default now) with its ``params``
        and JSON ``files`` (dict, artifact file name); returns
        ``(experiment_id, parent_run_id)``."""
        from mlflow.entities import Param

        try:
            self.experiment_id = self.experiment(experiment)
        except Exception as e:
            self._open_error = e  # every later write of this study fails with it
            raise
        parent = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags,
                                        start_time=start_time)
        self.parent_run_id = parent.info.run_id
        self.client.log_batch(self.parent_run_id, params=[Param(k, v) for k, v in params])
        for content, name in files:
            self.client.log_dict(self.parent_run_id, content, name)
        return self.experiment_id, self.parent_run_id

    def find_study_run(self, experiment: str = DEFAULT_EXPERIMENT) -> str | None:
        """The run of the study this sink's tags name (``pipetune.study_id``), if the
        store has one: a study killed before its journal heard its run's id."""
        study_id = self.tags.get("pipetune.study_id")
        if not study_id:
            return None
        experiment_id = self.experiment(experiment)
        runs = self.client.search_runs(
            [experiment_id], f"tags.`pipetune.study_id` = '{study_id}' and "
            "tags.`pipetune.kind` = 'study'", max_results=1)
        return runs[0].info.run_id if runs else None

    def study_ids(self) -> tuple[str | None, str | None]:
        """``(experiment_id, parent_run_id)`` of the study's run, once opened."""
        return self.experiment_id, self.parent_run_id

    def add_tags(self, tags: dict[str, str]) -> None:
        """``tags`` on the study's run and its trial runs, and on those created later."""
        self.tags = {**self.tags, **tags}
        pairs = sorted(tags.items())
        if self.parent_run_id is not None:
            self.log(self.parent_run_id, tags=pairs)
        for trial_id in list(self._children):
            self.log(("trial", trial_id), tags=pairs)

    def resume_study(self, run_id: str, experiment: str = DEFAULT_EXPERIMENT,
                     ) -> tuple[str, dict[int, str]]:
        """Continue the parent run ``run_id`` (RUNNING again) and its trial runs; returns
        ``(experiment_id, {trial id: child run id})``."""
        ensure_experiment(self._uri(), experiment)
        self.parent_run_id = run_id
        self.experiment_id = self.client.get_run(run_id).info.experiment_id
        self._children = self.runs.children_from_store()
        # What the study's last run left waiting goes first (its end, KILLED, included).
        if self._spooling and not self._send_waiting(force=True):
            raise StoreUnavailable(
                f"MLflow at {self._uri()} did not answer ({self._unavailable}): the study's "
                f"waiting writes in {self._spool.path} must be sent before it resumes")
        self.client.update_run(run_id, status="RUNNING")
        return self.experiment_id, dict(self._children)

    def reopen(self, run_ids: Sequence[str]) -> None:
        """Trial runs running again (a resumed study): a failure they ended with (the
        checkpoint store refused them) no longer stands."""
        self.idle()
        self._write("reopen", list(run_ids))

    def artifact_uri(self) -> str:
        return self.client.get_run(self.parent_run_id).info.artifact_uri

    def finish_study(self, metrics: Sequence[tuple[str, float, int, int]] = (),
                     params: Sequence[tuple[str, str]] = (),
                     tags: Sequence[tuple[str, str]] = (),
                     texts: Sequence[tuple[str, str]] = (),
                     files: Sequence[tuple[bytes, str]] = (),
                     best_model: tuple[str, dict[str, Any], str] | None = None,
                     best_trial: int | None = None, end: bool = True,
                     end_time: int | None = None) -> SpoolNote | None:
        """Everything sent before written, then the study's summary on its parent run:
        ``texts`` (content, artifact file name), ``files`` (bytes, artifact file name),
        ``best_model`` (checkpoint reference, ``best_model.json`` record, recipe) under
        ``best_model/``, the tag ``best_trial_run_id``; with ``end``, the run ends
        FINISHED at ``end_time`` (ms since the epoch; default now). Returns what waits
        in the spool, if anything (the store did not answer even now)."""
        self.idle()
        if best_model is not None:  # the record as JSON data, as the spool keeps it
            import json

            best_model = (best_model[0], json.loads(json.dumps(best_model[1], default=str)),
                          best_model[2])
        self._write("finish_study", list(metrics), list(params), list(tags), list(texts),
                    list(files), best_model, best_trial, end, end_time, force=True)
        return self.waiting()

    def fail_study(self, status: str, reason: str | None = None,
                   end_time: int | None = None) -> SpoolNote | None:
        """What was sent written as far as it can be, then every trial run still
        running ended KILLED and the parent run ended ``status`` (with ``reason`` as its
        ``pipetune.failure`` tag), all at ``end_time`` (ms since the epoch; default
        now). Never raises for one run: what cannot be written is logged; the first
        failure is raised at the end (the caller says what was lost). With a spool,
        what the store did not answer waits there, and is returned."""
        error: Exception | None = None
        try:
            self.idle()
        except Exception as e:  # noqa: BLE001 - the runs are still ended
            error = e
        try:
            self._write("fail_study", status, reason, end_time, force=True)
        except Exception as e:  # noqa: BLE001
            error = error or e
        if error is not None:
            # What waits in the spool is still said (the caller ends the runs itself).
            with contextlib.suppress(Exception):
                error.spool_note = self.waiting()  # type: ignore[attr-defined]
            raise error
        return self.waiting()

    def _uri(self) -> str:
        return self.runs.uri()

    def children_from_store(self) -> dict[int, str]:
        """Trial id -> run id of the study's trial runs, as the store has them."""
        return self.runs.children_from_store()

    def log(self, run: Hashable, metrics: Sequence[tuple[str, float, int, int]] = (),
            params: Sequence[tuple[str, str]] = (), tags: Sequence[tuple[str, str]] = ()) -> None:
        buf = self._pending.setdefault(run, _Buffer())
        buf.metrics.extend(metrics)
        buf.params.update(params)
        buf.tags.update(tags)

    def idle(self) -> None:
        """Write everything buffered (or spool it, behind what waits); try to send what
        waits (every :data:`RETRY_S`); raise the first failure after trying every run."""
        pending, self._pending = self._pending, {}
        error: Exception | None = None
        for run, buf in pending.items():
            try:
                tags = list(buf.tags.items())
                if buf.create is not None:  # created with the tags sent for it by now
                    self._write("create_child", *buf.create, tags[:MAX_TAGS_PER_BATCH])
                    tags = tags[MAX_TAGS_PER_BATCH:]
                if buf.metrics or buf.params or tags:
                    self._write("log_batch", run, buf.metrics, list(buf.params.items()), tags)
            except Exception as e:  # noqa: BLE001 - the other runs are still written
                if error is None:
                    error = e
                else:
                    logger.warning("MLflow write failed too: %s: %s", type(e).__name__, e)
        if self._spooling:
            self._send_waiting(force=False)
        refused, self._refused = self._refused, None
        error = error or refused
        if error is not None:
            raise error

    def create_child(self, trial_id: int, start_time: int | None = None) -> None:
        """The run of trial ``trial_id``, a child of the study's, starting at ``start_time``
        (ms since the epoch; default now): created at the next write of what is buffered,
        in order, with the tags sent for it by then (one store call where two were)."""
        self._pending.setdefault(("trial", trial_id), _Buffer()).create = (trial_id, start_time)

    def log_profiles(self, run: Hashable, rows: list[dict[str, Any]]) -> None:
        import pandas as pd

        self.idle()
        self._write("log_text", run, pd.DataFrame(rows).to_csv(index=False), "profiles.csv")

    def log_text(self, run: Hashable, content: str, name: str) -> None:
        """``content`` as the artifact file ``name`` of ``run``."""
        self.idle()
        self._write("log_text", run, content, name)

    def terminate(self, run: Hashable, status: str, end_time: int | None = None) -> None:
        """``run`` ended ``status`` at ``end_time`` (ms since the epoch; default now)."""
        self.idle()
        self._write("terminate", run, status, end_time)

    def children(self) -> dict[int, str]:
        """Everything sent so far written (or spooled); trial id -> child run id."""
        self.idle()
        return dict(self._children)

    # -- the spool ------------------------------------------------------------------------
    def _write(self, op: str, *args: Any, force: bool = False) -> None:
        """``op`` written now; with a spool, behind what waits there, or into it when the
        store does not answer (``force``: try to send what waits now, not at the next
        :data:`RETRY_S`)."""
        if self._open_error is not None:
            raise self._open_error
        if self._spool is None:
            self._apply(op, args, unsure=False)
            return
        if self._spooling and not self._send_waiting(force=force):
            self._spool.append(op, args, self._header())
            return
        try:
            self._apply(op, args, unsure=False)
        except Exception as e:
            if not store_unavailable(e):
                raise
            self._spool.append(op, args, self._header())
            self._spooling, self._unavailable = True, e
            self._next_try = time.monotonic() + RETRY_S
            logger.info("MLflow at %s does not answer (%s: %s); writes wait in %s",
                           self._uri(), type(e).__name__, e, self._spool.path)

    def _apply(self, op: str, args: Sequence[Any], *, unsure: bool) -> None:
        if op not in SPOOLED_OPS:
            raise WriterError(f"unknown spooled write {op!r}")
        if self._spool is None:
            getattr(self.runs, op)(*args, unsure=unsure)
            return
        with quick_requests(SUMMARY_TIMEOUT_S if op == "finish_study" else None):
            getattr(self.runs, op)(*args, unsure=unsure)

    def _header(self) -> dict[str, Any]:
        return {"tracking_uri": self._uri(), "experiment_id": self.experiment_id,
                "parent_run_id": self.parent_run_id, "tags": self.tags,
                "study_id": self.tags.get("pipetune.study_id")}

    def _send_waiting(self, *, force: bool) -> bool:
        """Send what waits, in order, unless tried less than :data:`RETRY_S` ago (and not
        ``force``); True once nothing waits."""
        if not force and time.monotonic() < self._next_try:
            return False
        sent, error = self._drain()
        self._unavailable = error
        if error is not None:
            self._next_try = time.monotonic() + RETRY_S
            return False
        if self._spooling:
            logger.info("MLflow at %s answers again: %d waiting write(s) sent",
                           self._uri(), sent)
        self._spooling = False
        return True

    def _drain(self) -> tuple[int, Exception | None]:
        """``(writes sent, the error of the store that stopped the sending)``. The first
        write of each try is checked against the store (it may have landed before its
        call failed); one the store refuses is dropped, logged and raised by ``idle``."""
        assert self._spool is not None
        sent = 0
        with self._spool.locked():
            _, writes = self._spool.read()
            if writes and timed_out(self._unavailable):
                try:  # a write that timed out may still be on its way in the server
                    with quick_requests():
                        self.client.get_experiment(self.experiment_id)
                except Exception as e:  # noqa: BLE001
                    if store_unavailable(e):
                        return 0, e
                time.sleep(SETTLE_S)
            for i, entry in enumerate(writes):
                op, args = entry["op"], from_json(entry["args"])
                if op in RUN_OPS and isinstance(args[0], list):
                    args[0] = tuple(args[0])
                try:
                    self._apply(op, args, unsure=i == 0)
                except Exception as e:  # noqa: BLE001 - the rest is sent, or waits
                    if store_unavailable(e):
                        return sent, e
                    logger.warning("MLflow refused a waiting write (%s #%s): %s: %s", op,
                                   entry["seq"], type(e).__name__, e)
                    self._refused = self._refused or e
                self._spool.acknowledge(entry["seq"])
                sent += 1
            self._spool.remove()
        return sent, None

    def waiting(self) -> SpoolNote | None:
        """What waits in the spool, if anything."""
        if self._spool is None or not self._spooling:
            return None
        count = self._spool.waiting()
        if not count:
            return None
        return SpoolNote(str(self._spool.path), count, self._uri(),
                         self.tags.get("pipetune.study_id"))

    def send_waiting(self) -> int:
        """Send every write that waits in the spool, each once (``pipetune tracking
        flush``); returns how many. Raises the store's error if it still does not
        answer, or the first refusal."""
        if self._spool is None:
            return 0
        if self.parent_run_id is not None and self.experiment_id is not None:
            with quick_requests():
                self._children.update(self.runs.children_from_store())
        sent, error = self._drain()
        if error is not None:
            raise error
        refused, self._refused = self._refused, None
        if refused is not None:
            raise refused
        self._spooling = False
        return sent


#: The writes a spool holds (:class:`StudyRuns` methods); those whose first argument is a run.
SPOOLED_OPS = frozenset({"create_child", "log_batch", "log_text", "terminate", "reopen",
                         "finish_study", "fail_study"})
RUN_OPS = frozenset({"log_batch", "log_text", "terminate"})
