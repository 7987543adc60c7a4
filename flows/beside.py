"""The study flow's run, in a thread beside the training (:mod:`flows.first` says why):
:func:`flow_beside` starts it once the study trains; the flow run witnesses the study
(:class:`~flows.first.StartedStudy`) instead of opening one."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from flows.first import StartedStudy, attached


class FlowBeside(threading.Thread):
    """The study flow's run, in a thread beside the training: it waits for the Prefect
    API (``wait_api``), imports the flow and calls it on ``started``. :attr:`error` is
    what it raised (the API never answered, the flow run failed)."""

    def __init__(self, started: StartedStudy, wait_api: Callable[[], Any],
                 flow_kwargs: dict[str, Any], own_server: bool,
                 around: Callable[[], contextlib.AbstractContextManager] | None = None):
        super().__init__(name="pipetune-flow-run", daemon=True)
        self.started = started
        self._wait_api = wait_api
        self._kwargs = flow_kwargs
        self._own_server = own_server
        self._around = around or contextlib.nullcontext
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None
        #: Set once the flow run exists (or the thread gave up before it could).
        self.created = threading.Event()

    def run(self) -> None:
        try:
            self._wait_api()
            self._run_flow()
        except BaseException as e:  # noqa: BLE001 - the command says it, after the study
            self.error = e
        finally:
            self.created.set()

    def _run_flow(self) -> None:
        """The flow run; created again while the API does not answer (a server of the
        user's restarting), until the study is done and ``$PIPETUNE_PREFECT_CATCH_UP_S``
        (10 s) more have passed. A run whose end the API missed is settled Completed
        once it answers again, if the study finished."""
        import os
        import time

        from flows.study import flow_settings, settle_flow_run, study_flow  # Prefect, now
        from pipetune.net import api_unreachable

        catch_up_s = float(os.environ.get("PIPETUNE_PREFECT_CATCH_UP_S") or 10.0)
        done_at: float | None = None
        while True:
            try:
                with flow_settings(own_server=self._own_server), self._around(), \
                        attached(self.started):
                    self.result = study_flow(**self._kwargs)
                return
            except Exception as e:
                if not api_unreachable(e):
                    raise
                if self.started.done.is_set() and done_at is None:
                    done_at = time.monotonic()
                if done_at is not None and time.monotonic() - done_at > catch_up_s:
                    raise
                if self.started.flow_run_id is None:
                    time.sleep(1.0)  # not created yet: try again
                    continue
                if self.started.summary is None:
                    raise  # the study failed: its flow run's end is not worth waiting for
                self._settle(settle_flow_run, catch_up_s)
                return

    def _settle(self, settle: Callable[[str, str], None], catch_up_s: float) -> None:
        """Record the finished study's flow run Completed once the API answers again."""
        import time

        from pipetune.net import api_unreachable

        deadline = time.monotonic() + catch_up_s
        assert self.started.flow_run_id is not None and self.started.summary is not None
        while True:
            try:
                settle(self.started.flow_run_id, "the study finished (recorded after the "
                       "Prefect API answered again)")
                self.result = {**self.started.summary, "flow_run_id": self.started.flow_run_id}
                return
            except Exception as e:
                if not api_unreachable(e) or time.monotonic() > deadline:
                    raise
                time.sleep(1.0)


def flow_beside(started: StartedStudy, wait_api: Callable[[], Any], *, own_server: bool,
                around: Callable[[], contextlib.AbstractContextManager] | None = None,
                **flow_kwargs: Any) -> FlowBeside:
    """Start the study flow's run for ``started`` in a thread (see :class:`FlowBeside`);
    ``own_server``: the API is a server started for this one command; ``around()``: a
    context the flow is called in (the command's console, once Prefect is loaded)."""
    thread = FlowBeside(started, wait_api, flow_kwargs, own_server, around)
    thread.start()
    return thread
