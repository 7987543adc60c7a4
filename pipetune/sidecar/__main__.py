"""The recorder process, ``python -m pipetune.sidecar``: reads what a
:class:`~pipetune.sidecar.ProcessHost` sends, calls each sink in its own thread in the
order sent, and writes the replies back. Run as a module of the package, so the errors
it sends back (``pipetune.sidecar.SidecarError``, a sink's own) unpickle in the parent.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from pipetune.sidecar import _HEADER, DRAIN_S, SidecarError, _read_message, _Runner

logger = logging.getLogger("pipetune.sidecar")  # run with -m, __name__ is "__main__"


def _pack(value: Any, error: BaseException | None) -> tuple[bytes, bytes | None]:
    """A reply's value and error, pickled apart (the caller reads one even if the other
    cannot be read there); what cannot be pickled is said in words."""
    try:
        value_b = pickle.dumps(value)
    except Exception as e:  # noqa: BLE001
        value_b = pickle.dumps(None)
        error = error or SidecarError(f"the reply could not be sent: {type(e).__name__}: {e}")
    if error is None:
        return value_b, None
    try:
        return value_b, pickle.dumps(error)
    except Exception:  # noqa: BLE001
        return value_b, pickle.dumps(SidecarError(f"{type(error).__name__}: {error}"))


def main(preload: list[str]) -> NoReturn:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us after its writes
    if preload[:1] == ["--spare"]:  # a spare: its command connects later (.spare)
        from pipetune.sidecar.spare import wait_for_command

        path, preload = preload[1], preload[2:]
        inp, out = wait_for_command(path, lambda: _warm_up(preload))
        preload = []
    else:
        inp = sys.stdin.buffer
        out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr  # a print in a sink must not corrupt the replies
    out_lock = threading.Lock()
    runner = _Runner("pipetune-recorder")  # the preload's, and any sink never attached

    def replier(rid: int | None) -> Callable[[Any, BaseException | None], None] | None:
        if rid is None:
            return None

        def reply(value: Any, error: BaseException | None) -> None:
            data = pickle.dumps((rid, *_pack(value, error)))
            with out_lock:
                out.write(_HEADER.pack(len(data)) + data)
                out.flush()
        return reply

    def warm() -> None:
        for module in preload:
            try:
                importlib.import_module(module)
            except Exception as e:  # noqa: BLE001 - the sink that needs it will say
                logger.warning("recorder: could not preload %s: %s", module, e)

    # One thread per sink: a sink that waits on a slow server (Prefect's) does not hold
    # back another's writes (MLflow's), and each keeps its own order.
    runners = {"_preload": runner}
    runner.put(("attach", "_preload", lambda: warm(), None))
    while True:
        message = _read_message(inp)
        if message is None:  # the parent closed our input, or died: finish, then exit
            break
        *item, rid = message
        key = item[1]
        if item[0] == "attach" and key not in runners:
            runners[key] = _Runner(f"pipetune-recorder-{key}")
        target = runners.get(key, runner)
        target.put((*item, replier(rid)))
        if item[0] == "detach" and key in runners and key != "_preload":
            runners.pop(key).put(("stop", None))
    for each in runners.values():
        each.put(("stop", None))
    # Our input closed: a normal stop, or the parent died. What was sent gets up to
    # DRAIN_S to be written (a dead parent's servers may be gone too), then we go.
    deadline = time.monotonic() + DRAIN_S
    for each in runners.values():
        each.join(max(0.0, deadline - time.monotonic()))
    if any(each.alive() for each in runners.values()):
        logger.warning("recorder: writes still pending after %s s; exiting", DRAIN_S)
        sys.stderr.flush()
        os._exit(1)
    # Everything sent is written: leave without the interpreter's teardown of mlflow,
    # prefect and pandas (1-2 s the parent's exit waited for).
    logging.shutdown()
    with contextlib.suppress(OSError):  # a dead parent's end of the pipe
        out.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _warm_up(preload: list[str]) -> None:
    """A spare's imports, done before any command needs them; and the working folder's
    MLflow store (``mlflow.db``, if there) opened, its tables mapped, once."""
    for module in preload:
        with contextlib.suppress(Exception):
            importlib.import_module(module)
    if os.path.exists("mlflow.db"):
        with contextlib.suppress(Exception):
            from mlflow.tracking import MlflowClient

            from pipetune.home import default_tracking_uri

            MlflowClient(default_tracking_uri()).search_experiments(max_results=1)


if __name__ == "__main__":
    main(sys.argv[1:])
