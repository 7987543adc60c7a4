"""Start and stop a local Prefect API server for one run, on loopback.

This module does not import Prefect: it runs the ``prefect`` command that ships with
the installed package, in its own process group, and talks HTTP to it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pipetune.errors import PipetuneError
from pipetune.net import free_port

#: Prefect's setting for how many times its clients retry a call.
_CLIENT_RETRIES = "PREFECT_CLIENT_MAX_RETRIES"
#: Settings naming the server's database; when the user sets one, it is used as is.
_DATABASE_SETTINGS = (
    "PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")
#: The servers pipetune starts store task runs and events in batches (Prefect's defaults:
#: the task-run recorder one transaction per event, the event persister flushing every
#: 5 s). A study's recorder sends each task-run state as an event (``tasks.task_runs``);
#: one transaction per event cost the server ~0.8 of a core in a 500-trial study on 2
#: cores, batches ~0.4 (``benchmarks/RESULTS.md``, "Load"). Set in the environment, they
#: win: a user's value is kept.
RECORDER_SETTINGS = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "1",
}


#: How many times the embedded server of one command is started again when it dies
#: (``$PIPETUNE_PREFECT_RESTARTS``, default 3; 0: never).
RESTARTS_ENV = "PIPETUNE_PREFECT_RESTARTS"
#: How long a study's task-run recorder waits, at the end, for a Prefect API that does
#: not answer (``tasks.task_run_sink.TaskRunSink``).
CATCH_UP_ENV = "PIPETUNE_PREFECT_CATCH_UP_S"


def healthy(api_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, TimeoutError):
        return False


def prefect_executable() -> str:
    candidate = Path(sys.executable).with_name("prefect")
    return str(candidate) if candidate.exists() else "prefect"


class LocalPrefectServer:
    """A ``prefect server start`` child process bound to ``host`` on a free port.

    >>> with LocalPrefectServer(log_path="/tmp/prefect.log") as server:  # doctest: +SKIP
    ...     os.environ["PREFECT_API_URL"] = server.api_url
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None,
                 log_path: str | Path | None = None, startup_timeout: float = 120.0,
                 restarts: int = 0):
        self.host = host
        self.port = port or free_port(host)
        self.api_url = f"http://{host}:{self.port}/api"
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout = startup_timeout
        #: Seconds a stopping server gets to exit on SIGTERM before SIGKILL: its SQLite
        #: writes are transactions, so nothing is lost if it is cut short.
        self.stop_grace_s = 2.0
        self.process: subprocess.Popen | None = None
        self._db_lock: Any = None
        #: Called with the exit code if the server dies while in use (not by :meth:`stop`).
        self.on_lost: Callable[[int], None] | None = None
        #: The server's exit code once it died while in use; None while it serves.
        self.lost_code: int | None = None
        #: How many more times a server that dies in use is started again, on the same
        #: port and database (its clients retry; what they sent meanwhile catches up).
        self.restarts_left = restarts
        #: Called with the lost server's exit code once it serves again.
        self.on_restarted: Callable[[int], None] | None = None
        #: Exit codes of the servers lost and started again.
        self.restarted: list[int] = []
        self._serving = threading.Event()  # set while a server answers
        self._settled = threading.Event()  # cleared while a lost server is started again
        self._settled.set()
        self._lock = threading.Lock()
        self._stopped = False
        self._launched = False
        self._database_url: str | None = None

    def start(self) -> LocalPrefectServer:
        """Launch the server and wait until it is healthy."""
        return self.launch().wait_healthy()

    def launch_once(self) -> LocalPrefectServer:
        """:meth:`launch`, unless it was launched (or stopped) already: safe from any
        thread, any number of times."""
        with self._lock:
            if self.process is None and not self._stopped and not self._launched:
                self._launched = True
                self.launch()
        return self

    def launch(self) -> LocalPrefectServer:
        """Start the server process and return at once (see :meth:`wait_healthy`)."""
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
        env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        for name, value in RECORDER_SETTINGS.items():
            env.setdefault(name, value)
        env["PREFECT_SERVER_API_HOST"] = self.host
        env["PREFECT_SERVER_API_PORT"] = str(self.port)
        if not any(k in env for k in _DATABASE_SETTINGS):
            if self._database_url is None:
                self._database_url = self._claim_database(env)
            env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = self._database_url
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path, "ab")  # noqa: SIM115 - closed once the child has it
        else:
            out = subprocess.DEVNULL
        # Under pipetune._watch, which holds our end of a pipe: the server goes with us
        # even if this process is SIGKILLed.
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pipetune._watch", "--", prefect_executable(), "server",
                 "start", "--host", self.host, "--port", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                # Its own process group (Ctrl-C is ours to pass on), not its own session:
                # with Linux's autogroup a session is a CPU group as heavy as all of
                # ours, so a busy server would take half the cores from the epochs.
                env=env, process_group=0,
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # the child has its own
        return self

    def _claim_database(self, env: dict[str, str]) -> str:
        """A SQLite database no other embedded server of this home is using.

        Two servers on one SQLite file race each other's migrations at boot and lock
        each other's writes; so each server takes the first free slot, held by a file
        lock for as long as this object lives: ``prefect.db`` (Prefect's own default,
        kept warm for the next run), else ``prefect-1.db``, ``prefect-2.db``, ..."""
        import fcntl

        home = Path(env.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
        home.mkdir(parents=True, exist_ok=True)
        for slot in range(64):
            db = home / ("prefect.db" if slot == 0 else f"prefect-{slot}.db")
            lock = open(db.with_name(db.name + ".pipetune-lock"), "a")  # noqa: SIM115
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue
            self._db_lock = lock  # released when this server object goes (or the process)
            return f"sqlite+aiosqlite:///{db}"
        raise PipetuneError(f"64 local Prefect servers already use {home}")

    def wait_healthy(self) -> LocalPrefectServer:
        """Wait until the server answers. One that dies while it boots (killed, out of
        memory) is started again while ``restarts`` last, as one that dies in use is
        (``on_lost``, then ``on_restarted`` once it serves)."""
        proc = self.process
        assert proc is not None, "launch() first"
        deadline = time.monotonic() + self.startup_timeout
        lost: list[int] = []
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                code = proc.returncode
                with self._lock:
                    again = (not self._stopped and self.process is proc
                             and self.restarts_left > 0)
                    if again:
                        self.restarts_left -= 1
                        self.launch()
                        proc = self.process
                if not again:
                    raise PipetuneError(
                        f"the local Prefect server exited with code {code}"
                        + (f"; see {self.log_path}" if self.log_path else "")
                    )
                lost.append(code)
                self.lost_code = code
                if self.on_lost is not None:
                    self.on_lost(code)
                continue
            if healthy(self.api_url):
                with self._lock:  # not if stop() came meanwhile
                    if self._stopped or self.process is not proc:
                        raise PipetuneError("the local Prefect server was stopped")
                    threading.Thread(target=self._warm_up, name="pipetune-prefect-warm-up",
                                     daemon=True).start()
                    threading.Thread(target=self._watch_for_loss, args=(proc,),
                                     name="pipetune-prefect-watch", daemon=True).start()
                    self._serving.set()
                for code in lost:
                    self.restarted.append(code)
                    self.lost_code = None
                    if self.on_restarted is not None:
                        self.on_restarted(code)
                return self
            time.sleep(0.1)
        self.stop()
        raise PipetuneError(
            f"the local Prefect server did not become healthy within {self.startup_timeout:.0f} s"
        )

    def _watch_for_loss(self, proc: subprocess.Popen) -> None:
        """Tell ``on_lost`` if the server dies under its users: killed, out of memory;
        then start it again (``restarts``). The watcher it runs under exits with it, so
        its exit is the server's."""
        code = proc.wait()
        if self.process is not proc:  # stopped by us: stop() lets go of it first
            return
        self._serving.clear()
        self._settled.clear()
        try:
            self.lost_code = code
            if self.on_lost is not None:
                self.on_lost(code)
            try:
                with self._lock:
                    if self._stopped or self.process is not proc or self.restarts_left <= 0:
                        return
                    self.restarts_left -= 1
                    self.launch()
                self.wait_healthy()
            except Exception as e:  # noqa: BLE001 - it stays lost; its clients say so
                with contextlib.suppress(OSError):
                    self._say_in_log(f"pipetune: starting the Prefect server again failed: {e}")
                return
            self.restarted.append(code)
            self.lost_code = None
            if self.on_restarted is not None:
                self.on_restarted(code)
        finally:
            self._settled.set()

    def _say_in_log(self, line: str) -> None:
        if self.log_path:
            with open(self.log_path, "a") as out:
                out.write(line + "\n")

    def wait_serving(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds while the server is being started again;
        whether it answers (False as soon as it is lost for good). A server that died a
        moment ago, before its watch thread saw it, is waited for too."""
        deadline = time.monotonic() + timeout
        while True:
            settled = self._settled.is_set()
            if settled and self._serving.is_set() and healthy(self.api_url):
                return True
            lost = settled and not self._serving.is_set()
            if lost or time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def _warm_up(self) -> None:
        """One API request, now, in the background: the server builds its API routes on
        the first request it routes (FastAPI's lazy route build, ~0.4 s of its CPU
        here), which is then paid while the caller still waits on its other start-up
        instead of by its first real call."""
        with contextlib.suppress(Exception):
            urllib.request.urlopen(f"{self.api_url}/admin/version", timeout=30).read()

    def wait_idle(self, timeout: float) -> None:
        """Wait while the server works (its processes used more than a tenth of a core
        over the last half second: storing events it took), at most ``timeout`` s."""
        import psutil

        proc = self.process
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]
        except (AttributeError, psutil.Error):
            return

        def cpu_s() -> float:
            total = 0.0
            for each in tree:
                with contextlib.suppress(psutil.Error):
                    total += sum(each.cpu_times()[:2])
            return total

        deadline, last = time.monotonic() + timeout, cpu_s()
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = cpu_s()
            if now - last < 0.05:
                return
            last = now

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        self._serving.clear()
        try:
            self._stop()
        finally:
            lock, self._db_lock = self._db_lock, None
            if lock is not None:
                lock.close()

    def _stop(self) -> None:
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        # Closing our end of its stdin is how pipetune._watch is asked to stop the server
        # (SIGTERM to it, then it exits itself): the server is down in ~0.2 s. A SIGTERM
        # to the watcher's group instead reached the watcher inside its wait for the
        # server, where its own stop could not reap it: every stop waited out the whole
        # grace and ended in SIGKILL.
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=self.stop_grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except (OSError, ValueError):  # a broken pipe: it is gone or going; make sure
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def __enter__(self) -> LocalPrefectServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def prefect_api(
    log_path: str | Path | None = None,
    on_url: Callable[[str], None] | None = None,
    before_wait: Callable[[], None] | None = None,
    on_exit: Callable[[], None] | None = None,
    wait: bool = True,
    launch: bool = True,
) -> Iterator[LocalPrefectServer | None]:
    """The Prefect API for one command: the one ``PREFECT_API_URL`` names if set, else a
    :class:`LocalPrefectServer` started here (its URL exported for child processes, such
    as Dask workers) and stopped on exit. Yields the server it started, or None.

    The server's start overlaps the caller's own start-up: ``on_url(url)`` is called
    once the URL is exported, then the server is launched, then ``before_wait()`` runs
    (checking the job, say) before waiting for the server to be healthy. If either
    raises, the server is stopped. ``on_exit()`` runs on the way out, just before the
    server is stopped (so the caller's own clean-up can start beside the stop). With
    ``wait=False`` it yields the server still booting: the caller waits for it
    (:meth:`LocalPrefectServer.wait_healthy`) where it needs it; with ``launch=False``
    not even launched (its URL is exported all the same): the caller launches it
    (:meth:`LocalPrefectServer.launch_once`) once its own start-up is done."""
    if os.environ.get("PREFECT_API_URL"):
        if on_url is not None:
            on_url(os.environ["PREFECT_API_URL"])
        if before_wait is not None:
            before_wait()
        try:
            yield None
        finally:
            if on_exit is not None:
                on_exit()
        return
    print(f"starting a local Prefect server on 127.0.0.1 (log: {log_path}) ...", file=sys.stderr)
    try:
        restarts = int(os.environ.get(RESTARTS_ENV) or 3)
    except ValueError:
        raise PipetuneError(f"{RESTARTS_ENV} must be a whole number of restarts, got "
                            f"{os.environ[RESTARTS_ENV]!r}") from None
    server = LocalPrefectServer(log_path=log_path, restarts=max(0, restarts))
    os.environ["PREFECT_API_URL"] = server.api_url
    # A server started again takes 5-12 s here: the study's task-run recorder waits that
    # long for it at the end (not its 10 s default), unless the user set how long.
    catch_up_ours = restarts > 0 and CATCH_UP_ENV not in os.environ
    if catch_up_ours:
        os.environ[CATCH_UP_ENV] = "45"
    # A server on loopback that does not answer is gone (it dies with this command, and
    # nobody restarts it): Prefect's clients retry each call for ~1 min by default
    # (5 tries, 2 s doubling), which held the command's end for minutes after a lost
    # server. One retry (~2 s) here; a value the user set is kept.
    retries_ours = _CLIENT_RETRIES not in os.environ
    if retries_ours:
        os.environ[_CLIENT_RETRIES] = "1"
    try:
        if launch:
            server.launch_once()
        if on_url is not None:
            on_url(server.api_url)
        if before_wait is not None:
            before_wait()
        if wait:
            server.launch_once().wait_healthy()
        yield server
    finally:
        if on_exit is not None:
            on_exit()
        server.stop()
        os.environ.pop("PREFECT_API_URL", None)
        if catch_up_ours:
            os.environ.pop(CATCH_UP_ENV, None)
        if retries_ours:
            os.environ.pop(_CLIENT_RETRIES, None)
