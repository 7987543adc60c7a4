"""Ordered calls off the study loop: in a thread, or in a child process off its GIL.

The study loop hands its bookkeeping (MLflow writes, the Prefect task-run record) to a
*sink*, an object whose methods are called in the order they were sent, one at a
time, by a host:

- :class:`ThreadHost` calls them in a daemon thread of this process;
- :class:`ProcessHost` calls them in a child process (``python -m pipetune.sidecar``,
  whose loop is :mod:`pipetune.sidecar.__main__`), so their CPU work never holds this
  process's GIL while the loop waits for an epoch.
  Measured here: MLflow's SQLAlchemy writes and Prefect's task-run bookkeeping in
  threads of the study process added 70-100 ms to every epoch's round trip.

A sink may buffer: after the host has drained what was queued it calls the sink's
``idle()`` (and every :data:`IDLE_S` with nothing queued), so writes sent in a burst go
out together; a sink still attached when the host stops gets ``drain()`` if it has one,
else ``idle()``. A sink's exception is kept (the
first; later ones are counted) and raised, in the caller, by the next :meth:`Channel.call`
or :meth:`Channel.close`. When the parent dies, the child writes what it was sent
before it exits: a SIGKILLed study keeps every record it had handed over.
"""

from __future__ import annotations

import atexit
import importlib
import itertools
import logging
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, BinaryIO

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
#: Seconds the recorder takes to finish what it was sent once its input closes.
DRAIN_S = 10.0
#: A sink's ``idle()`` runs at least this often (seconds), writes or not: what it holds
#: back or retries (a spooled MLflow write, a task run's Running state) goes out then.
IDLE_S = 0.5


class SidecarError(RuntimeError):
    """The host cannot finish what was sent (it died, or timed out)."""


def _build(target: str, kwargs: dict[str, Any]) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(**kwargs)


class _Runner:
    """One daemon thread calling sink methods in the order they were queued.

    Items: ``("attach", key, factory, reply)``, ``("call", key, method, args, reply)``,
    ``("detach", key, reply)``, ``("stop", reply)``. ``reply(value, error)`` (or
    ``None``) hears the call's value and the sink's pending error."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._sinks: dict[str, Any] = {}
        self._errors: dict[str, tuple[BaseException, int]] = {}
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, item: tuple) -> None:
        self._queue.put(item)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _keep_error(self, key: str, error: BaseException, say: bool = True) -> None:
        first, more = self._errors.get(key, (error, -1))
        self._errors[key] = (first, more + 1)
        if say:  # not when a caller waits for this very call: it hears the error itself
            logger.warning("%s failed: %s: %s", key, type(error).__name__, error)

    def _take_error(self, key: str) -> BaseException | None:
        error, more = self._errors.pop(key, (None, 0))
        if error is not None and more:
            error.add_note(f"({more} more call(s) of {key} failed after this one)")
        return error

    def _idle(self, final: bool = False) -> None:
        for key, sink in list(self._sinks.items()):
            idle = (final and getattr(sink, "drain", None)) or getattr(sink, "idle", None)
            if idle is not None:
                try:
                    idle()
                except Exception as e:  # noqa: BLE001 - kept for the next call
                    self._keep_error(key, e)

    def _loop(self) -> None:
        while True:
            try:  # with nothing to do, each sink's idle() still runs every IDLE_S
                items = [self._queue.get(timeout=IDLE_S)]
            except queue.Empty:
                self._idle()
                continue
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item[0] == "stop":  # unclosed sinks send all they hold back, now
                    self._idle(final=True)
                    if item[1] is not None:
                        item[1](None, None)
                    return
                self._handle(item)
            self._idle()

    def _handle(self, item: tuple) -> None:
        kind, key = item[0], item[1]
        reply: Callable[[Any, BaseException | None], None] | None = item[-1]
        value = None
        try:
            if kind == "attach":
                factory = item[2]
                self._sinks[key] = factory() if callable(factory) else _build(*factory)
            elif kind == "call":
                sink = self._sinks.get(key)
                if sink is None:
                    raise SidecarError(f"{key} is not attached (its creation failed)")
                value = getattr(sink, item[2])(*item[3])
            elif kind == "detach":
                sink = self._sinks.pop(key, None)
                idle, close = (getattr(sink, n, None) for n in ("idle", "close"))
                for step in (idle, close):
                    if step is not None:
                        step()
        except Exception as e:  # noqa: BLE001 - kept for the next call
            self._keep_error(key, e, say=reply is None)
        if reply is not None:
            error = self._take_error(key)
            try:
                reply(value, error)
            except Exception as e:  # noqa: BLE001 - the caller must hear something
                logger.warning("%s: reply failed: %s", key, e)
                try:
                    reply(None, SidecarError(f"{key}: the reply failed: "
                                             f"{type(e).__name__}: {e}"))
                except OSError:  # nobody to hear it (the caller died): write on
                    pass


class _Reply:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def __call__(self, value: Any, error: BaseException | None) -> None:
        self.value, self.error = value, error
        self.done.set()


class Channel:
    """One sink on a host: :meth:`send` returns at once, :meth:`call` waits for the
    answer (and everything sent before it), :meth:`close` writes what is left and
    drops the sink. ``call`` and ``close`` raise the sink's pending error."""

    def __init__(self, host: _Host, key: str):
        self.host, self.key = host, key
        self.closed = False

    def send(self, method: str, *args: Any) -> None:
        if self.closed:
            raise SidecarError(f"{self.key} is closed")
        self.host._put(("call", self.key, method, args), None)

    def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        if self.closed:
            raise SidecarError(f"{self.key} is closed")
        return self.host._ask(("call", self.key, method, args), timeout)

    def close(self, timeout: float | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        self.host._ask(("detach", self.key), timeout)


class _Host:
    def _put(self, item: tuple, reply: _Reply | None) -> None:
        raise NotImplementedError

    def _alive(self) -> bool:
        raise NotImplementedError

    def _ask(self, item: tuple, timeout: float | None) -> Any:
        reply = _Reply()
        self._put(item, reply)
        remaining = timeout
        while not reply.done.wait(0.5 if remaining is None else min(0.5, remaining)):
            if not self._alive():
                raise SidecarError(f"{self.name} is gone; what was sent to it is lost")
            if remaining is not None:
                remaining -= 0.5
                if remaining <= 0:
                    raise SidecarError(f"{item[1]}: not done after {timeout} s")
        if reply.error is not None:
            raise reply.error
        return reply.value

    name = "host"


class ThreadHost(_Host):
    """Sinks called in a daemon thread of this process."""

    def __init__(self, name: str = "pipetune-sidecar"):
        self.name = name
        self._runner = _Runner(name)
        self._keys = itertools.count()

    def attach(self, sink: Any, key: str = "sink") -> Channel:
        key = f"{key}-{next(self._keys)}"
        self._put(("attach", key, lambda: sink), None)
        return Channel(self, key)

    def _put(self, item: tuple, reply: _Reply | None) -> None:
        self._runner.put((*item, reply))

    def _alive(self) -> bool:
        return self._runner.alive()

    def stop(self, timeout: float | None = None) -> None:
        self._ask(("stop",), timeout)


class ProcessHost(_Host):
    """Sinks built and called in one child process, ``python -m pipetune.sidecar``.

    Messages cross a pipe as length-prefixed pickles, written by a feeder thread (the
    caller never blocks on a full pipe). The child has the parent's ``sys.path``,
    ignores SIGINT (the parent stops it, after the last writes), and exits once its
    input closes, having done everything it was sent."""

    def __init__(self, name: str = "pipetune-recorder", preload: tuple[str, ...] = ()):
        self.name = name
        self._proc = _spare() or _child(preload)
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._replies: dict[int, _Reply] = {}
        self._ids = itertools.count()
        self._keys = itertools.count()
        self._broken: str | None = None
        threading.Thread(target=self._feed, name=f"{name}-feed", daemon=True).start()
        threading.Thread(target=self._read, name=f"{name}-read", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def attach(self, target: str, key: str = "sink", **kwargs: Any) -> Channel:
        """Build ``target`` (``"module:callable"``) with ``kwargs`` in the child."""
        key = f"{key}-{next(self._keys)}"
        self._put(("attach", key, (target, kwargs)), None)
        return Channel(self, key)

    def wait_ready(self, timeout: float | None = 120.0) -> None:
        """Return once the child has started and imported its ``preload``."""
        self._ask(("detach", "_preload"), timeout)

    def _put(self, item: tuple, reply: _Reply | None) -> None:
        with self._lock:
            if self._broken is not None:
                raise SidecarError(f"{self.name} is gone ({self._broken})")
            rid = None
            if reply is not None:
                rid = next(self._ids)
                self._replies[rid] = reply
            self._queue.put(pickle.dumps((*item, rid), protocol=pickle.HIGHEST_PROTOCOL))

    def _alive(self) -> bool:
        return self._broken is None and self._proc.poll() is None

    def _feed(self) -> None:
        pipe = self._proc.stdin
        assert pipe is not None
        try:
            while True:
                data = self._queue.get()
                if data is None:
                    break
                pipe.write(_HEADER.pack(len(data)) + data)
                if self._queue.empty():
                    pipe.flush()
            pipe.close()
        except (OSError, ValueError) as e:
            self._fail(f"its input pipe broke: {e}")

    def _read(self) -> None:
        pipe = self._proc.stdout
        assert pipe is not None
        try:
            while True:
                message = _read_message(pipe)
                if message is None:
                    break
                rid, value, error = message
                with self._lock:
                    reply = self._replies.pop(rid, None)
                if reply is not None:
                    reply(*_unpack(value, error))
        except Exception as e:  # noqa: BLE001 - a torn reply: the channel is unusable
            self._fail(f"unreadable reply: {type(e).__name__}: {e}")
            return
        self._fail(f"exit code {self._proc.wait()}")

    def _fail(self, why: str) -> None:
        with self._lock:
            if self._broken is None:
                self._broken = why
            replies, self._replies = self._replies, {}
        for reply in replies.values():
            reply(None, SidecarError(f"{self.name} is gone ({why}); what was sent is lost"))

    def stop(self, timeout: float = 60.0) -> None:
        """Everything sent is done, then the child exits. Idempotent."""
        with self._lock:
            if self._broken is None:
                self._queue.put(None)
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not finish its writes in %s s; killed", self.name, timeout)
            self._proc.kill()
            self._proc.wait()


def _child(preload: tuple[str, ...]) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("PIPETUNE_SPARE_RECORDER", None)
    env["PYTHONPATH"] = os.pathsep.join(
        p or os.getcwd() for p in sys.path if isinstance(p, str))
    return subprocess.Popen([sys.executable, "-m", "pipetune.sidecar", *preload],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)


def _spare() -> Any:
    """The warm service's spare recorder, taken (once per process), or None
    (:mod:`pipetune.sidecar.spare`)."""
    path = os.environ.pop("PIPETUNE_SPARE_RECORDER", None)
    if not path:
        return None
    from pipetune.sidecar.spare import adopt

    return adopt(path)


_SHARED: ProcessHost | None = None
_SHARED_LOCK = threading.Lock()


def shared_host(preload: tuple[str, ...] = ()) -> ProcessHost:
    """This process's recorder process, started on first use (``preload``: modules it
    imports at once, so the first sink does not wait for them); stopped at exit."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or not _SHARED._alive():
            _SHARED = ProcessHost(preload=preload)
            atexit.register(_SHARED.stop)
        return _SHARED


def _read_message(pipe: BinaryIO) -> Any | None:
    header = pipe.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = pipe.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


def _unpack(value_b: bytes, error_b: bytes | None) -> tuple[Any, BaseException | None]:
    error: BaseException | None = None
    if error_b is not None:
        try:
            error = pickle.loads(error_b)
        except Exception as e:  # noqa: BLE001
            error = SidecarError(f"the recorder raised an error that cannot be read here: {e}")
    try:
        return pickle.loads(value_b), error
    except Exception as e:  # noqa: BLE001
        return None, error or SidecarError(f"the reply cannot be read here: {e}")
