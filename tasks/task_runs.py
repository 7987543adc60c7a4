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

import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from pipetune.sidecar import Channel, shared_host


class TaskRunSink:
    """In the recorder process: creates and settles the task runs of one flow run."""

    def __init__(self, api_url: str, flow_run_id: str):
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        from tasks.epoch import train_epoch
        from tasks.tuning import decide_system, lookup_groundtruth

        self._tasks = {t.name: t for t in (train_epoch, lookup_groundtruth, decide_system)}
        # This process may have imported Prefect before the study's API was known.
        with temporary_settings(updates={PREFECT_API_URL: api_url} if api_url else {}):
            self._client = get_client(sync_client=True)
            self._client.__enter__()
        self._flow_run_id = uuid.UUID(flow_run_id)
        self._last: dict[int, uuid.UUID] = {}

    def start(self, run_id: str, task: str, name: str, trial_id: int, at: float) -> None:
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

    def finish(self, run_id: str, at: float, error: str | None = None,
               cancelled: bool = False) -> None:
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
        self._client.__exit__(None, None, None)


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
