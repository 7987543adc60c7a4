"""The study's task runs, written to Prefect from the recorder process.

Running a Prefect task run per epoch in the study process (the engine's contexts,
state events, its thread) cost the study loop ~50 ms of every epoch's round trip
here, and the profile lookup and tuning decision as task runs another ~25 ms between
epochs: GIL time the loop waited for. So the engine does that work itself, emits what
it did with its times (:mod:`pipetune.events`), and :class:`TaskRunWriter` tells
Prefect what ran: each ``train-epoch``, ``profile-lookup``
and ``tune-system`` is still one task run of the flow run, named as before, Running
while it runs and Completed (or Failed, Cancelled) with the real times, and linked to
the trial's previous task run so the UI draws each trial as a chain. The API calls
happen in the recorder process (:mod:`pipetune.sidecar`), never in the loop.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from pipetune.sidecar import Channel, shared_host


class TaskRunSink:
    """In the recorder process: creates and settles the task runs of one flow run.

    The Prefect API may stop answering mid-study (its server killed, restarting, its
    network gone): training goes on, so nothing here raises for that. Each state is
    queued in the order it was sent and written in that order; while the API does not
    answer, writes are tried again after a growing pause (1 s doubling to 15 s) as
    more states arrive, so the ones queued go in, in order, once it answers again. At
    :meth:`close` the sink waits up to ``catch_up_s`` (default: ``$PIPETUNE_PREFECT_CATCH_UP_S``,
    else 10 s) for the API, trying every second, then raises :class:`PrefectUnreachable`
    saying how many states Prefect never got."""

    def __init__(self, api_url: str, flow_run_id: str, catch_up_s: float | None = None):
        from prefect.client.orchestration import get_client
        from prefect.context import get_settings_context
        from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES

        from tasks.epoch import train_epoch
        from tasks.tuning import decide_system, lookup_groundtruth

        self._tasks = {t.name: t for t in (train_epoch, lookup_groundtruth, decide_system)}
        # This process may have imported Prefect before the study's API was known. No
        # retries inside a call (Prefect's own back off for a minute per call): the
        # sink backs off itself, between calls, without holding the queue.
        context = get_settings_context()
        updates: dict = {PREFECT_CLIENT_MAX_RETRIES: 0}
        if api_url:
            updates[PREFECT_API_URL] = api_url
        self._settings = (context.profile, context.settings.copy_with_update(updates=updates))
        with self._settings_context():
            self._client = get_client(sync_client=True)
            self._client.__enter__()
        self._api_url = api_url or str(PREFECT_API_URL.value() or "")
        self._flow_run_id = uuid.UUID(flow_run_id)
        self._last: dict[int, uuid.UUID] = {}
        self.catch_up_s = catch_up_s if catch_up_s is not None else float(
            os.environ.get("PIPETUNE_PREFECT_CATCH_UP_S") or 10.0)
        self._queued: collections.deque[tuple[str, tuple]] = collections.deque()
        self._pause_s = 0.0
        self._retry_at = 0.0
        self._unanswered: BaseException | None = None  # the last reason, while it lasts

    def _settings_context(self):
        from prefect.context import SettingsContext

        profile, settings = self._settings
        return SettingsContext(profile=profile, settings=settings)

    def start(self, run_id: str, task: str, name: str, trial_id: int, at: float) -> None:
        self._queued.append(("_create", (run_id, task, name, trial_id, at)))
        self._write_queued()

    def finish(self, run_id: str, at: float, error: str | None = None,
               cancelled: bool = False) -> None:
        self._queued.append(("_settle", (run_id, at, error, cancelled)))
        self._write_queued()

    def idle(self) -> None:
        self._write_queued()

    def _write_queued(self) -> bool:
        """Write what is queued, in order, unless the API is in a pause; whether all is."""
        if self._queued and time.monotonic() < self._retry_at:
            return False
        while self._queued:
            method, args = self._queued[0]
            try:
                with self._settings_context():
                    getattr(self, method)(*args)
            except Exception as e:
                if not _unanswered(e):
                    self._queued.popleft()  # a refusal: said once, never retried
                    raise
                self._unanswered = e
                self._pause_s = min(15.0, max(1.0, self._pause_s * 2))
                self._retry_at = time.monotonic() + self._pause_s
                return False
            self._queued.popleft()
            self._pause_s, self._unanswered = 0.0, None
        return True

    def _create(self, run_id: str, task: str, name: str, trial_id: int, at: float) -> None:
        from prefect.client.schemas.objects import TaskRunResult
        from prefect.states import Running

        rid = uuid.UUID(run_id)
        before = self._last.get(trial_id)
        self._client.create_task_run(
            task=self._tasks[task], flow_run_id=self._flow_run_id, dynamic_key=run_id,
            id=rid, name=name, extra_tags=[f"trial-{trial_id}"],
            state=Running(timestamp=_when(at)),
            task_inputs={"wait_for": [TaskRunResult(id=before)]} if before else {},
        )
        self._last[trial_id] = rid

    def _settle(self, run_id: str, at: float, error: str | None, cancelled: bool) -> None:
        from prefect.states import Cancelled, Completed, Failed

        when = _when(at)
        if cancelled:
            state = Cancelled(timestamp=when, message="the study stopped")
        elif error is not None:
            state = Failed(timestamp=when, message=error[:5000])
        else:
            state = Completed(timestamp=when)
        self._client.set_task_run_state(uuid.UUID(run_id), state, force=True)

    def close(self) -> None:
        """Write what is still queued, waiting up to ``catch_up_s`` for the API."""
        deadline = time.monotonic() + self.catch_up_s
        try:
            self._retry_at = 0.0  # the end: no pause left to wait out, one try a second
            while not self._write_queued():
                now = time.monotonic()
                if now >= deadline:
                    break
                time.sleep(min(1.0, deadline - now))
                self._retry_at = 0.0
        finally:
            self._client.__exit__(None, None, None)
        if self._queued:
            e = self._unanswered
            raise PrefectUnreachable(
                f"the Prefect API at {self._api_url} stopped answering "
                f"({type(e).__name__}: {e}): {len(self._queued)} task-run state(s) of "
                f"flow run {self._flow_run_id} are not recorded there")


class PrefectUnreachable(RuntimeError):
    """The Prefect API did not answer: some task-run states were never written."""


def _unanswered(error: BaseException) -> bool:
    """Whether ``error`` means the API did not answer (down, restarting, unreachable,
    overloaded), as opposed to refusing the call."""
    import httpx

    if isinstance(error, httpx.TransportError):
        return True
    response = getattr(error, "response", None)
    return getattr(response, "status_code", 0) in (502, 503, 504)


def _when(at: float) -> datetime:
    return datetime.fromtimestamp(at, UTC)


class TaskRunWriter:
    """In the study process: what ran, sent to a :class:`TaskRunSink` (no waiting)."""

    def __init__(self, flow_run_id: str, api_url: str, channel: Channel | None = None):
        # Without an API URL this process runs Prefect's in-process (ephemeral) server,
        # which the recorder process cannot reach: then nothing is written.
        self.enabled = channel is not None or bool(api_url and flow_run_id)
        self._channel = channel
        if self._channel is None and self.enabled:
            self._channel = shared_host().attach(
                "tasks.task_runs:TaskRunSink", "prefect", api_url=api_url,
                flow_run_id=flow_run_id)
        self._open: dict[str, None] = {}
        self._lock = threading.Lock()

    def _send(self, *message: Any) -> None:
        if self._channel is not None:
            self._channel.send(*message)

    def started(self, task: str, name: str, trial_id: int) -> str:
        run_id = str(uuid.uuid4())
        with self._lock:
            self._open[run_id] = None
        self._send("start", run_id, task, name, trial_id, time.time())
        return run_id

    def finished(self, run_id: str, error: str | None = None) -> None:
        with self._lock:
            self._open.pop(run_id, None)
        self._send("finish", run_id, time.time(), error)

    def ran(self, task: str, name: str, trial_id: int, started: float, ended: float,
            error: str | None = None) -> None:
        """A task run that already happened, from ``started`` to ``ended`` (an engine
        event's times); Failed with ``error`` when given."""
        run_id = str(uuid.uuid4())
        self._send("start", run_id, task, name, trial_id, started)
        self._send("finish", run_id, ended, error)

    def cancel_open(self) -> None:
        """Every task run still running ends Cancelled (the study stopped)."""
        with self._lock:
            runs, self._open = list(self._open), {}
        for run_id in runs:
            self._send("finish", run_id, time.time(), None, True)

    def close(self, timeout: float | None = 60.0) -> None:
        """Wait until Prefect has every task-run state sent so far; raise what a call raised."""
        if self._channel is not None:
            self._channel.close(timeout)


def api_url() -> str:
    """The Prefect API this process talks to (the recorder talks to the same one)."""
    from prefect.settings import PREFECT_API_URL

    return str(PREFECT_API_URL.value() or "")
