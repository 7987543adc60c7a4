"""The study's task runs, written to Prefect from the recorder process: the sink that
:class:`~tasks.task_runs.TaskRunWriter` feeds (attached in the recorder by name,
``tasks.task_run_sink:TaskRunSink``), sending them as the events Prefect's own task
engine emits, in batches."""

from __future__ import annotations

import collections
import itertools
import os
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from pipetune.net import api_unreachable
from tasks.epoch import evaluate_checkpoint, train_epoch
from tasks.tuning import decide_system, lookup_groundtruth

#: Set (to 1) by ``pipetune tune`` on the warm service's server: see TaskRunSink.
TRUST_TAKEN_ENV = "PIPETUNE_PREFECT_TRUST_TAKEN"


class PrefectUnreachable(RuntimeError):
    """The Prefect API did not answer: some task-run states were never written."""


#: An epoch's wait before it started on its worker is said from this long (seconds).
WAIT_SAID_S = 0.1


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat()



class TaskRunSink:
    """In the recorder process: records the task runs of one flow run in Prefect.

    Each state is sent the way Prefect's own task engine records a task run since
    Prefect 3: as a ``prefect.task-run.<State>`` event, which the server's task-run
    recorder turns into the task run and its state. The events queued since the last
    write go in one ``POST /api/events`` (not two orchestrated API calls per task run):
    one request per recorder pass, whatever the study's pace. A Running state is held
    :attr:`HOLD_RUNNING_S` first: a task run that ends by then is one event.

    The Prefect API may stop answering mid-study (its server killed, restarting, its
    network gone): training goes on, so nothing here raises for that. Events are
    queued in the order they happened and sent in that order; while the API does not
    answer, writes are tried again after a growing pause (1 s doubling to 15 s) as more
    arrive. A server killed may have taken events it had not yet stored, so when the
    API stops answering, the events sent in the :data:`RESEND_S` before are queued again
    ahead of the rest (a state is keyed by its event's id: one stored twice is one).
    At :meth:`close` the sink waits up to ``catch_up_s`` (default:
    ``$PIPETUNE_PREFECT_CATCH_UP_S``, else 10 s) for the API and for every task run to
    be stored in its last state, sending again what is missing, then raises
    :class:`PrefectUnreachable` saying how many task runs Prefect does not have."""

    RESEND_S = 30.0  # how far back a lost server may have dropped events it had taken
    BATCH = 500  # events per request
    HOLD_RUNNING_S = 2.0  # a Running state waits this long for its task run's end

    def __init__(self, api_url: str, flow_run_id: str, catch_up_s: float | None = None):
        from prefect.client.orchestration import get_client
        from prefect.context import get_settings_context
        from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES

        self._task_keys = {t.name: t.task_key for t in
                           (train_epoch, lookup_groundtruth, decide_system,
                            evaluate_checkpoint)}
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
        self._last: dict[int, str] = {}  # trial -> its last task run (the chain's link)
        self._runs: dict[str, dict[str, Any]] = {}  # running task run -> its fields
        # Every settled task run -> the id of its last state's event (what Prefect must
        # hold at the end); the events themselves only while they may be sent again.
        self._final_ids: dict[str, str] = {}
        self._final: dict[str, dict[str, Any]] = {}
        self.catch_up_s = catch_up_s if catch_up_s is not None else float(
            os.environ.get("PIPETUNE_PREFECT_CATCH_UP_S") or 10.0)
        self._queued: collections.deque[dict[str, Any]] = collections.deque()
        self._sent: collections.deque[tuple[float, dict[str, Any]]] = collections.deque()
        # A Running state still queued when its task run ends is not sent: the final
        # state's event carries the start time too, so a lookup, a decision (sent when
        # done) or an epoch that ended before the recorder's next pass is one event.
        self._unsent: dict[str, dict[str, Any]] = {}
        # A Running state waits here HOLD_RUNNING_S before it is queued: a task run
        # that ends by then (an epoch of a second or two) is one event, not two. At
        # 32 epochs a second the Prefect server spent 10 ms of CPU an event.
        self._held: dict[str, tuple[float, dict[str, Any]]] = {}
        self._pause_s = 0.0
        self._retry_at = 0.0
        self._unanswered: BaseException | None = None  # the last reason, while it lasts
        #: The API is pipetune's warm server (pipetune.service), which outlives this
        #: command and stops only seconds after its last command: what it took, it
        #: stores, so :meth:`close` waits for it to take everything, not to store it.
        self.trust_taken = os.environ.get(TRUST_TAKEN_ENV) == "1"

    def _settings_context(self):
        from prefect.context import SettingsContext

        profile, settings = self._settings
        return SettingsContext(profile=profile, settings=settings)

    def start(self, run_id: str, task: str, name: str, trial_id: int, at: float) -> None:
        before = self._last.get(trial_id)
        self._last[trial_id] = run_id
        self._runs[run_id] = {
            "name": name, "task_key": self._task_keys[task], "dynamic_key": run_id,
            "tags": [f"trial-{trial_id}"], "labels": {}, "empirical_policy": {},
            "task_inputs": {"wait_for": [{"input_type": "task_run", "id": before}]}
            if before else {},
            "run_count": 1, "flow_run_run_count": 1, "expected_start_time": _iso(at),
            "start_time": _iso(at),
        }
        event = self._event(run_id, self._runs[run_id], at, "RUNNING", "Running", None, None)
        self._held[run_id] = (time.monotonic(), event)

    def finish(self, run_id: str, at: float, error: str | None = None,
               cancelled: bool = False, began: float | None = None) -> None:
        run = self._runs.pop(run_id, None)
        if run is None:  # never started here (or settled already): nothing to settle
            return
        started = datetime.fromisoformat(run["start_time"]).timestamp()
        waited = None
        if began is not None and started < began < at:  # the work's own start
            waited, started = began - started, began
            run["start_time"] = _iso(began)
        # Later than the Running state, always: Prefect keeps a task run's newest state
        # by timestamp, and a decision replayed on resume starts and ends at one instant.
        at = max(at, started + 1e-6)
        run.update(end_time=_iso(at), total_run_time=max(0.0, at - started))
        if cancelled:
            state = ("CANCELLED", "Cancelled", "the study stopped")
        elif error is not None:
            state = ("FAILED", "Failed", error[:5000])
        else:
            state = ("COMPLETED", "Completed", None if waited is None else
                     f"ran {at - started:.2f} s on its worker" + (
                         f", {waited:.2f} s after it was sent (a worker starting, the "
                         "workload's build, a wait for a free slot)"
                         if waited >= WAIT_SAID_S else ""))
        event = self._event(run_id, run, at, *state, "RUNNING")
        self._held.pop(run_id, None)  # the final state alone says it all
        running = self._unsent.pop(run_id, None)
        if running is not None:  # not sent yet: the final state alone says it all
            running["superseded"] = True
        self._final[run_id] = event
        self._final_ids[run_id] = event["id"]
        self._queued.append(event)

    def idle(self) -> None:
        self._write_queued()

    def drain(self) -> None:
        """Send everything, the Running states held back too: the recorder stops (its
        parent died) without closing this sink."""
        self._write_queued(hold_s=0.0)

    def _event(self, run_id: str, run: dict[str, Any], at: float, kind: str, name: str,
               message: str | None, before: str | None) -> dict[str, Any]:
        """One state of task run ``run_id`` (``run``: its fields) as Prefect's task
        engine writes it."""
        state = {"type": kind, "name": name, "message": message or "", "state_details": {},
                 "data": None}
        return {
            "id": str(uuid.uuid4()), "occurred": _iso(at), "event": f"prefect.task-run.{name}",
            "resource": {
                "prefect.resource.id": f"prefect.task-run.{run_id}",
                "prefect.resource.name": run["name"], "prefect.run-count": "1",
                "prefect.state-message": message or "", "prefect.state-name": name,
                "prefect.state-timestamp": _iso(at), "prefect.state-type": kind,
                "prefect.orchestration": "client",
            },
            "related": [
                {"prefect.resource.id": f"prefect.flow-run.{self._flow_run_id}",
                 "prefect.resource.role": "flow-run"},
                *({"prefect.resource.id": f"prefect.tag.{tag}", "prefect.resource.role": "tag"}
                  for tag in run["tags"]),
            ],
            "payload": {
                "intended": {"from": before, "to": kind},
                "initial_state": {"type": before, "name": before.title(), "message": "",
                                  "state_details": {}} if before else None,
                "validated_state": state,
                "task_run": dict(run),
            },
        }

    def _release_held(self, hold_s: float) -> None:
        """Queue the Running states held ``hold_s`` or longer, oldest first."""
        now = time.monotonic()
        while self._held:
            run_id, (held_at, event) = next(iter(self._held.items()))
            if now - held_at < hold_s:
                return
            del self._held[run_id]
            self._unsent[run_id] = event
            self._queued.append(event)

    def _write_queued(self, hold_s: float | None = None) -> bool:
        """Send what is queued, in order, unless the API is in a pause; whether all is.
        Running states held less than ``hold_s`` (default :attr:`HOLD_RUNNING_S`) wait."""
        self._release_held(self.HOLD_RUNNING_S if hold_s is None else hold_s)
        if self._queued and time.monotonic() < self._retry_at:
            return False
        while self._queued:
            count = min(self.BATCH, len(self._queued))
            batch = [event for event in itertools.islice(self._queued, count)
                     if not event.get("superseded")]
            try:
                refused = self._post(batch)
            except Exception as e:
                if not api_unreachable(e):
                    raise
                if self._unanswered is None:  # the outage starts: what it may have lost
                    self._queued.extendleft(reversed([ev for _, ev in self._sent]))
                    self._sent.clear()
                self._unanswered = e
                self._pause_s = min(15.0, max(1.0, self._pause_s * 2))
                self._retry_at = time.monotonic() + self._pause_s
                return False
            now = time.monotonic()
            for _ in range(count):
                self._queued.popleft()
            for event in batch:
                self._unsent.pop(event["payload"]["task_run"]["dynamic_key"], None)
                self._sent.append((now, event))
            while self._sent and self._sent[0][0] < now - self.RESEND_S:
                _, old = self._sent.popleft()
                run_id = old["payload"]["task_run"]["dynamic_key"]
                if self._final.get(run_id) is old:  # past resending: only its id is kept
                    del self._final[run_id]
            self._pause_s, self._unanswered = 0.0, None
            if refused is not None:
                raise refused
        return True

    def _post(self, batch: list[dict[str, Any]]) -> Exception | None:
        """Send ``batch``; raises when the API does not answer. When it refuses the
        batch, each event is sent alone and only those it refuses are dropped: the
        first refusal is returned (said once, never retried)."""
        if not batch:
            return None
        try:
            with self._settings_context():
                self._client.request("POST", "/events", json=batch).raise_for_status()
            return None
        except Exception as e:
            if api_unreachable(e) or len(batch) == 1:
                raise
        refused: Exception | None = None
        for event in batch:
            try:
                with self._settings_context():
                    self._client.request("POST", "/events", json=[event]).raise_for_status()
            except Exception as e:
                if api_unreachable(e):
                    raise
                refused = refused or e
        return refused

    def _missing(self, runs: list[str]) -> list[str]:
        """Those of ``runs`` Prefect does not hold in their last state (yet)."""
        missing: list[str] = []
        for i in range(0, len(runs), 200):
            chunk = runs[i:i + 200]
            with self._settings_context():
                response = self._client.request("POST", "/task_runs/filter", json={
                    "task_runs": {"id": {"any_": chunk}}, "limit": 200})
            response.raise_for_status()
            have = {r["id"]: r.get("state_id") for r in response.json()}
            missing += [r for r in chunk if have.get(r) != self._final_ids[r]]
        return missing

    def close(self) -> None:
        """Send what is still queued and see every task run stored in its last state,
        waiting up to ``catch_up_s`` for the API. What is still missing once the count
        stops falling is sent again (a server killed after it took them, and started
        again), at growing intervals."""
        deadline = time.monotonic() + self.catch_up_s
        # Until Prefect says otherwise: those still queued or sent within RESEND_S.
        missing = sorted({ev["payload"]["task_run"]["dynamic_key"] for ev in
                          [*self._queued, *(e for _, e in self._sent)]} & set(self._final_ids))
        checked: list[str] | None = None  # None: not asked yet
        gap_s, resend_at = 1.0, time.monotonic() + 1.0
        try:
            self._retry_at = 0.0  # the end: no pause left to wait out, one try a second
            while True:
                written = self._write_queued(hold_s=0.0)
                if written and self.trust_taken and self._unanswered is None:
                    return
                if written:
                    try:
                        now_missing = self._missing(
                            list(self._final_ids) if checked is None else checked)
                    except Exception as e:
                        if not api_unreachable(e):
                            raise
                        self._unanswered = e
                    else:
                        if not now_missing:
                            return
                        if checked is not None and len(now_missing) < len(checked):
                            resend_at = time.monotonic() + gap_s  # still being stored
                        elif time.monotonic() >= resend_at:
                            self._queued.extend(self._final[r] for r in now_missing
                                                if r in self._final)
                            gap_s = min(8.0, gap_s * 2)
                            resend_at = time.monotonic() + gap_s
                        checked = missing = now_missing
                now = time.monotonic()
                if now >= deadline:
                    break
                time.sleep(min(0.1 if self._unanswered is None else 1.0, deadline - now))
                self._retry_at = 0.0
        finally:
            self._client.__exit__(None, None, None)
        e = self._unanswered
        why = f"stopped answering ({type(e).__name__}: {e})" if e else "did not store them"
        raise PrefectUnreachable(
            f"the Prefect API at {self._api_url} {why}: {len(missing)} of "
            f"{len(self._final_ids)} task run(s) of flow run {self._flow_run_id} are not "
            f"recorded there in their last state")
