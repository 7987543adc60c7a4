"""What a flow run called in the CLI's own process shows on the terminal.

A refusal raised inside a flow (any :class:`~pipetune.errors.PipetuneError`) reaches
the terminal as the CLI's one ``error: ...`` line: Prefect's flow engine also logs it,
with its traceback ("Encountered exception during execution"), and that record is kept
off the console here. Records a flow logs with ``extra={"pipetune_notice": "warning"}``
(a space value dropped because no worker can run it) are printed as the CLI's own
``warning: ...`` lines instead of Prefect's log format. Prefect's API handler is left
alone: the flow run's Logs tab in the UI keeps the traceback and the notice.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from pipetune.errors import PipetuneError
from pipetune.net import api_unreachable
from pipetune.session import NOTICE_ATTR, SAID_ATTR  # log-record attributes

#: The loggers a flow run's records start from; their handlers up to the root are the
#: console's candidates.
_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


class FlowConsole:
    """What :func:`quiet_flow_tracebacks` yields: the notices printed so far, and a
    switch the caller sets once the study has finished (then the flow engine's report
    of an API that no longer answers stays off the console: the caller says it once)."""

    def __init__(self) -> None:
        self.notices: list[str] = []
        self.study_finished = False


class _QuietFlowConsole(logging.Filter):
    """Drops, from a console handler, the records the CLI shows its own way."""

    def __init__(self, console: FlowConsole) -> None:
        super().__init__("pipetune-quiet-flow-console")
        self._refusals: list[str] = []
        self._console = console

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, NOTICE_ATTR, None) or getattr(record, SAID_ATTR, None):
            return False
        if not record.name.startswith(_RUN_LOGGERS):
            return True
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, PipetuneError):
            self._refusals.append(str(error))
            return False
        if self._console.study_finished and (
                api_unreachable(error) or record.getMessage().startswith("Finished in state")):
            return False
        # Prefect's closing line repeats the refusal: "Finished in state Failed('Flow run
        # encountered an exception: SystemConfigError: ...')".
        if self._refusals:
            message = record.getMessage()
            if message.startswith("Finished in state") and any(
                    r in message for r in self._refusals):
                return False
        return True


class NoticeHandler(logging.Handler):
    """Prints a flow's notices as the CLI's own lines on stderr."""

    def __init__(self, console: FlowConsole) -> None:
        super().__init__()
        self._console = console

    def emit(self, record: logging.LogRecord) -> None:
        prefix = getattr(record, NOTICE_ATTR, None)
        if not prefix:
            return
        try:
            self._console.notices.append(record.getMessage())
            print(f"{prefix}: {record.getMessage()}", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - a closed stderr must not fail the flow
            self.handleError(record)


def _console_handlers() -> list[logging.Handler]:
    """Every handler a flow run's record reaches, but Prefect's API handlers (known by
    class name: the library's layers keep ``pipetune/`` from importing Prefect)."""
    found: list[logging.Handler] = []
    for name in _RUN_LOGGERS:
        logger: logging.Logger | None = logging.getLogger(name)
        while logger is not None:
            for handler in logger.handlers:
                to_api = any(c.__name__ == "APILogHandler" for c in type(handler).__mro__)
                if not to_api and handler not in found:
                    found.append(handler)
            logger = logger.parent if logger.propagate else None
    return found


@contextlib.contextmanager
def quiet_flow_tracebacks() -> Iterator[FlowConsole]:
    """While a flow runs in this process: a :class:`~pipetune.errors.PipetuneError`
    it raises leaves no traceback on the console (the CLI prints it as one line), and
    its notices print as ``warning: ...`` lines. Prefect's logs to its API keep both.

    >>> with quiet_flow_tracebacks():                     # doctest: +SKIP
    ...     study_flow(job=spec)
    """
    console = FlowConsole()
    quiet = _QuietFlowConsole(console)  # Prefect set its handlers up at the flow's import
    handlers = _console_handlers()
    for handler in handlers:
        handler.addFilter(quiet)
    notices = NoticeHandler(console)
    run_logger = logging.getLogger("prefect.flow_runs")
    run_logger.addHandler(notices)
    try:
        yield console
    finally:
        run_logger.removeHandler(notices)
        for handler in handlers:
            handler.removeFilter(quiet)
