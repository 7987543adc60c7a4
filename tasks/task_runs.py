"""The study's task runs, written to Prefect from the recorder process.

Running a Prefect task run per epoch in the study process (the engine's contexts,
state events, its thread) cost the study loop ~50 ms of every epoch's round trip
here, and the profile lookup and tuning decision as task runs another ~25 ms between
epochs: GIL time the loop waited for. So the engine does that work itself, emits what
it did with its times (:mod:`pipetune.engine.events`), and :class:`TaskRunWriter` tells
Prefect what ran: each ``train-epoch``, ``profile-lookup`` and ``tune-system`` is still
one task run of the flow run, named as before, Running while it runs (when the
recorder sees it running) and Completed (or Failed, Cancelled) with the real times, and
linked to the trial's previous task run so the UI draws each trial as a chain. The
task runs reach Prefect as the events its own task engine emits, in batches, from the
recorder process (:mod:`pipetune.sidecar`), never from the loop.

The sink writing them in the recorder is :mod:`tasks.task_run_sink`.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from pipetune.sidecar import Channel, shared_host


class TaskRunWriter:
    """In the study process: what ran, sent to a
    :class:`~tasks.task_run_sink.TaskRunSink` (no waiting).

    A writer made with :meth:`deferred` has no flow run yet (the study started before
    its flow run was created, beside it): it keeps what ran, in order, with its own
    times, until :meth:`bind` names the flow run, and sends it all then."""

    def __init__(self, flow_run_id: str | None, api_url: str, channel: Channel | None = None):
        self._open: dict[str, None] = {}
        self._lock = threading.Lock()
        self._held: list[tuple[Any, ...]] | None = None
        self._channel = None
        self.enabled = False
        if flow_run_id is None and channel is None:  # deferred: see bind
            self._held = []
            return
        self._attach(flow_run_id or "", api_url, channel)

    @classmethod
    def deferred(cls) -> TaskRunWriter:
        """A writer whose flow run is not known yet (:meth:`bind` gives it)."""
        return cls(None, "")

    @property
    def bound(self) -> bool:
        return self._held is None

    def _attach(self, flow_run_id: str, api_url: str, channel: Channel | None) -> None:
        # Without an API URL this process runs Prefect's in-process (ephemeral) server,
        # which the recorder process cannot reach: then nothing is written.
        self.enabled = channel is not None or bool(api_url and flow_run_id)
        self._channel = channel
        if self._channel is None and self.enabled:
            self._channel = shared_host().attach(
                "tasks.task_run_sink:TaskRunSink", "prefect", api_url=api_url,
                flow_run_id=flow_run_id)

    def bind(self, flow_run_id: str, api_url: str) -> None:
        """Name the flow run a deferred writer's task runs belong to and send what it
        kept, in order; from now on it sends as it goes."""
        with self._lock:
            if self._held is None:
                raise RuntimeError("this task-run writer has its flow run already")
            self._attach(flow_run_id, api_url, None)
            held, self._held = self._held, None
            for message in held:
                self._send_now(*message)

    def _send(self, *message: Any) -> None:
        with self._lock:
            if self._held is not None:
                self._held.append(message)
                return
        self._send_now(*message)

    def _send_now(self, *message: Any) -> None:
        if self._channel is not None:
            self._channel.send(*message)

    def started(self, task: str, name: str, trial_id: int) -> str:
        run_id = str(uuid.uuid4())
        with self._lock:
            self._open[run_id] = None
        self._send("start", run_id, task, name, trial_id, time.time())
        return run_id

    def finished(self, run_id: str, error: str | None = None,
                 began: float | None = None) -> None:
        """The task run ended now (Failed with ``error``). ``began``: when its work
        really started (an epoch on its worker): the run is Running from then, its wait
        before (a worker's start-up, a free slot) said in its final state's message."""
        with self._lock:
            self._open.pop(run_id, None)
        self._send("finish", run_id, time.time(), error, False, began)

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
        """Wait until Prefect has every task-run state sent so far; raise what a call
        raised. A deferred writer not bound yet keeps what it holds: it is closed by
        whoever binds it."""
        if self._channel is not None:
            self._channel.close(timeout)


def api_url() -> str:
    """The Prefect API this process talks to (the recorder talks to the same one)."""
    from prefect.settings import PREFECT_API_URL

    return str(PREFECT_API_URL.value() or "")
