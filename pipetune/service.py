"""The local Prefect server and Dask cluster, kept warm between ``pipetune tune`` commands.

Started by the first ``tune`` that needs them (no ``PREFECT_API_URL``, no Dask address),
detached, they serve every later command of the same interpreter, working folder and
settings, and stop on their own once no command has used them for the keep-warm time
(``PIPETUNE_KEEP_WARM_S``, default 600 s; ``0`` starts them per command instead, as
before). ``pipetune service status`` lists them, ``pipetune service stop`` stops them.

A later command pays neither the server's boot (about 3 CPU-s here) nor the workers'
start (torch imported once, in their fork server): its first epoch goes out as soon as
it has checked its job. What a warm worker still holds from earlier commands is checked
before each study (:mod:`pipetune.dask.fresh`): a worker that loaded a module changed
since, or one from another job's folder, is started again first.

Everything of one service lives in ``$PIPETUNE_HOME/service/<key>/``: ``service.json``
(what runs where), ``leases/<pid>`` (one per command using it; a dead command's lease
counts for nothing), ``service.log`` and the Prefect server's log.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pipetune.errors import PipetuneError, SpecError
from pipetune.sidecar.spare import pid_alive as _alive

#: Seconds the service stays up after its last command ended; 0: no service.
KEEP_WARM_ENV = "PIPETUNE_KEEP_WARM_S"
DEFAULT_KEEP_WARM_S = 600.0
RECORD = "service.json"
#: What makes two commands' workers interchangeable: the same interpreter, working
#: folder and these settings (the workers inherit them when the service starts).
_KEY_ENV = ("PIPETUNE_HOME", "PREFECT_HOME", "PYTHONPATH", "MLFLOW_DISABLE_TELEMETRY",
            "PREFECT_SERVER_ANALYTICS_ENABLED", "OMP_WAIT_POLICY", "OMP_NUM_THREADS",
            "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "DASK_LOGGING__DISTRIBUTED",
            "PREFECT_LOGGING_LEVEL", "PIPETUNE_WORKERS", "PIPETUNE_CORES_PER_WORKER")


def keep_warm_s(value: float | None = None) -> float:
    """The keep-warm time: ``value`` (``--keep-warm``) if given, else the environment's,
    else :data:`DEFAULT_KEEP_WARM_S`. A bad value is refused by name."""
    field, raw = ("--keep-warm", value) if value is not None else \
        (KEEP_WARM_ENV, os.environ.get(KEEP_WARM_ENV, "").strip() or None)
    if raw is None:
        return DEFAULT_KEEP_WARM_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise SpecError(field, f"must be a number of seconds >= 0 (0: no warm service), "
                               f"got {raw!r}")
    return seconds


def services_root() -> Path:
    from pipetune.home import pipetune_home

    return pipetune_home() / "service"


def service_key(cwd: str | None = None) -> str:
    parts = {"python": sys.executable, "cwd": os.path.realpath(cwd or os.getcwd()),
             "env": {k: os.environ.get(k) for k in _KEY_ENV}}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def code_fingerprint(*tops: str) -> str:
    """Newest change to pipetune's own source (an edited checkout must not be served by
    workers that imported the old one), and to the packages ``tops`` installed beside it
    (``flows``, ``tasks``: what a spare driver imports): the files' modification times,
    hashed."""
    here = Path(__file__).resolve().parent
    stamps = []
    for root in (here, *(here.parent / top for top in tops)):
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                if name.endswith(".py"):
                    with contextlib.suppress(OSError):
                        path = os.path.join(folder, name)
                        stamps.append(f"{path}:{os.stat(path).st_mtime_ns}")
    return hashlib.sha256("\n".join(sorted(stamps)).encode()).hexdigest()[:16]


def read_record(folder: Path) -> dict | None:
    try:
        return json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return None


def _write_record(folder: Path, record: dict) -> None:
    tmp = folder / f".{RECORD}.{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
    os.chmod(tmp, 0o600)
    os.replace(tmp, folder / RECORD)


@dataclass
class WarmService:
    """A command's hold on the warm service: its lease, and where things are."""

    folder: Path
    pid: int
    api_url: str
    started_here: bool
    idle_s: float

    @property
    def lease(self) -> Path:
        return self.folder / "leases" / str(os.getpid())

    def record(self) -> dict:
        return read_record(self.folder) or {}

    def wait_cluster(self, timeout: float = 180.0) -> dict:
        """The service's record once its Dask cluster serves (started here: waits)."""
        deadline = time.monotonic() + timeout
        while True:
            record = self.record()
            if record.get("pid") == self.pid and record.get("dask_address"):
                return record
            if not _alive(self.pid) or time.monotonic() > deadline:
                raise PipetuneError(
                    "the local service (Prefect server and Dask cluster) did not start; "
                    f"see {self.folder / 'service.log'}"
                    f" (or run with {KEEP_WARM_ENV}=0 to start them per command)")
            time.sleep(0.05)

    def wait_prefect(self, timeout: float = 120.0) -> None:
        """Until the service's Prefect server answers."""
        from pipetune.prefect_server import healthy

        deadline = time.monotonic() + timeout
        while not healthy(self.api_url, timeout=2.0):
            if not _alive(self.pid) or time.monotonic() > deadline:
                raise PipetuneError(f"the local Prefect server at {self.api_url} does not "
                                    f"answer; see {self.folder / 'prefect-server.log'}")
            time.sleep(0.1)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            self.lease.unlink()

    def stop(self) -> None:
        """Stop the service now (one this command started for a job it then refused)."""
        _stop_pid(self.pid)


def attach(idle_s: float) -> WarmService | None:
    """The warm service for this command (started now if none serves it), leased; None
    when the one there serves an older pipetune and another command still uses it (this
    command then starts its own server and cluster, as with a keep-warm time of 0)."""
    root = services_root()
    folder = root / service_key()
    (folder / "leases").mkdir(parents=True, exist_ok=True)
    fingerprint = code_fingerprint()
    with open(folder / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = read_record(folder)
        started_here = False
        if record and _alive(record["pid"]) and record.get("code") != fingerprint:
            if _live_leases(folder):
                return None  # serves pipetune as it was before an edit, to a running study
            _stop_pid(record["pid"])  # serves pipetune as it was before an edit
            record = None
        if not record or not _alive(record["pid"]):
            record = _launch(folder, idle_s, fingerprint)
            started_here = True
        elif float(record.get("idle_s", idle_s)) != idle_s:  # the newest command's wish
            record["idle_s"] = idle_s
            _write_record(folder, record)
        service = WarmService(folder=folder, pid=record["pid"], api_url=record["api_url"],
                              started_here=started_here, idle_s=float(record["idle_s"]))
        service.lease.write_text(json.dumps({"since": time.time()}))
    return service


def _live_leases(folder: Path) -> list[int]:
    """The commands using the service in ``folder`` now."""
    return [int(p.name) for p in (folder / "leases").glob("*")
            if p.name.isdigit() and _alive(int(p.name))]


def _launch(folder: Path, idle_s: float, fingerprint: str) -> dict:
    from pipetune.net import free_port

    port = free_port("127.0.0.1")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    log = open(folder / "service.log", "ab")  # noqa: SIM115 - the child has its own
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipetune.service", "serve", str(folder), str(idle_s),
             str(port)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True, cwd=os.getcwd())
    finally:
        log.close()
    record = {"pid": proc.pid, "api_url": f"http://127.0.0.1:{port}/api", "idle_s": idle_s,
              "code": fingerprint, "cwd": os.getcwd(), "python": sys.executable,
              "started": time.time(), "dask_address": None}
    _write_record(folder, record)
    return record


def _stop_pid(pid: int, grace: float = 20.0) -> bool:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        return False
    return True


def _spares_in(folder: Path, suffix: str) -> list[str]:
    """The spares with a ``<name>.<suffix>`` file in ``folder`` (``sock``: waiting;
    ``failed``: the last one exited before it waited)."""
    return sorted(p.stem for p in folder.glob(f"*.{suffix}") if p.stem in SPARE_NAMES)


def services() -> list[dict]:
    """Every service recorded under this pipetune home, with ``alive`` and ``leases``."""
    root = services_root()
    found = []
    for folder in sorted(root.iterdir()) if root.is_dir() else ():
        record = read_record(folder)
        if not record:
            continue
        leases = _live_leases(folder)
        found.append({**record, "folder": str(folder), "alive": _alive(record["pid"]),
                      "leases": leases, "spares": _spares_in(folder, "sock"),
                      "failed_spares": _spares_in(folder, "failed")})
    return found


def stop_all() -> list[dict]:
    """Stop every live service of this pipetune home; those stopped."""
    stopped = []
    for service in services():
        if service["alive"]:
            _stop_pid(service["pid"], grace=_STORE_MAX_S + 30.0)  # it lets its server store
            stopped.append(service)
    return stopped


# -- the service process ---------------------------------------------------------------


def serve(folder: Path, idle_s: float, port: int) -> int:
    """Run the Prefect server and the Dask cluster until idle for ``idle_s`` or stopped
    (SIGTERM, SIGINT)."""
    from pipetune.dask.cluster import WORKER_PROCESS_ENV, launch_forkserver, shared_cluster
    from pipetune.prefect_server import LocalPrefectServer

    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, lambda *_: stop.set())
    server = LocalPrefectServer(port=port, log_path=folder / "prefect-server.log", restarts=3)
    os.environ["PREFECT_API_URL"] = server.api_url  # the workers inherit it
    launch_forkserver()
    server.launch()
    cluster = None
    try:
        cluster = shared_cluster()
        with open(folder / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            record = read_record(folder) or {}
            policy = os.environ.get("OMP_WAIT_POLICY", WORKER_PROCESS_ENV["OMP_WAIT_POLICY"])
            record.update(pid=os.getpid(), dask_address=cluster.scheduler_address,
                          omp_wait_policy=policy, cluster_ready=time.time())
            _write_record(folder, record)
        server.wait_healthy()
        print(f"serving: Dask {cluster.scheduler_address}, Prefect {server.api_url}, "
              f"idle stop after {idle_s:.0f} s", flush=True)
        _wait_idle(folder, idle_s, stop)
    finally:
        _stop_spares(folder)
        print("stopping", flush=True)
        _wait_stored(server, folder)
        from pipetune.dask.cluster import close_shared_cluster

        with contextlib.suppress(Exception):
            close_shared_cluster()
        server.stop()
        record = read_record(folder)
        if record and record.get("pid") == os.getpid():
            with contextlib.suppress(OSError):
                (folder / RECORD).unlink()
    return 0


#: Seconds the service keeps its Prefect server after a command's lease ended, at least;
#: and at most, while the server is still busy storing.
_STORE_GRACE_S = 3.0
_STORE_MAX_S = 120.0


def _wait_stored(server, folder: Path) -> None:
    """Before the Prefect server stops: the last command ended trusting it with events
    it had taken but maybe not stored (its recorder flushes every second, and a study of
    many slots can send faster than 2 cores store: measured, 64 one-second epochs at
    once left half the study's task runs unstored 3 s later, lost at the stop). Wait
    :data:`_STORE_GRACE_S` after the last lease, then while the server works."""
    time.sleep(max(0.0, _STORE_GRACE_S - (time.time() - _last_lease_end(folder))))
    server.wait_idle(_STORE_MAX_S)


def _last_lease_end(folder: Path) -> float:
    """When a command last let go of this service (its lease file's removal, seen as
    the leases folder's modification time); 0 if never."""
    try:
        return os.stat(folder / "leases").st_mtime
    except OSError:
        return 0.0


class _Spare:
    """One kind of process the service keeps waiting for the next command, imports
    done: started again once the last one was taken (it warms up at idle priority: no
    CPU taken from a running command's epochs)."""

    def __init__(self, socket_name: str, log_name: str, argv: list[str]):
        self.socket_name, self.log_name, self.argv = socket_name, log_name, argv
        self.procs: list[subprocess.Popen] = []  # every one started; the last is newest
        self.seen_waiting = False
        self.started = 0.0

    def keep(self, folder: Path) -> None:
        for proc in self.procs[:-1]:  # reap those that served a command and exited
            if proc.poll() is not None:
                self.procs.remove(proc)
        newest = self.procs[-1] if self.procs else None
        failed = folder / f"{Path(self.socket_name).stem}.failed"
        if (folder / self.socket_name).exists():
            self.seen_waiting = True
            failed.unlink(missing_ok=True)
            return
        if newest is not None and not self.seen_waiting:
            if newest.poll() is None:
                return  # still importing
            failed.write_text(f"exit code {newest.returncode}; see {self.log_name}\n")
            if time.monotonic() - self.started < 60:
                return  # it died before it waited: not again at once
        with open(folder / self.log_name, "ab") as out:
            self.procs.append(subprocess.Popen(
                [sys.executable, *(str(folder / self.socket_name) if a == "{socket}" else a
                                   for a in self.argv)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                # Its own process group (it outlives a kill of ours while it serves a
                # command), not its own session: Linux's autogroup makes each session a
                # CPU group of its own, where idle priority would not stay idle and a
                # busy recorder or driver weighs as much as all the epochs (measured:
                # two warming spares took 3.2 of the first 9 CPU-s of a study).
                process_group=0))
        self.seen_waiting, self.started = False, time.monotonic()

    def stop(self, folder: Path) -> None:
        """Stop the one still waiting (one serving a command finishes on its own)."""
        newest = self.procs[-1] if self.procs else None
        waiting = (folder / self.socket_name).exists()
        if newest is not None and newest.poll() is None and (waiting or not self.seen_waiting):
            newest.terminate()  # waiting, or still warming up: nobody took it
        with contextlib.suppress(OSError):
            (folder / self.socket_name).unlink()
        for proc in self.procs:  # where each listened while it warmed up
            with contextlib.suppress(OSError):
                (folder / f"{self.socket_name}.{proc.pid}").unlink()


#: The spares a service keeps waiting: a recorder (:mod:`pipetune.sidecar.spare`) and a
#: study driver (:mod:`pipetune.cli.handover`), each at ``<name>.sock`` in its folder.
SPARE_NAMES = ("driver", "recorder")


def _spare_kinds() -> tuple[_Spare, ...]:
    from pipetune.sidecar.spare import SPARE_PRELOAD

    return (_Spare("recorder.sock", "recorder.log",
                   ["-m", "pipetune.sidecar", "--spare", "{socket}", *SPARE_PRELOAD]),
            # the driver's module is named, not imported: this layer never imports Prefect
            _Spare("driver.sock", "driver.log", ["-m", "pipetune.cli.handover", "{socket}"]))


_spares: list[_Spare] = []


def _keep_spares(folder: Path) -> None:
    if not _spares:
        _spares.extend(_spare_kinds())
    for spare in _spares:
        spare.keep(folder)


def _stop_spares(folder: Path) -> None:
    for spare in _spares:
        spare.stop(folder)


def _wait_idle(folder: Path, idle_s: float, stop: threading.Event) -> None:
    last_busy = time.monotonic()
    while not stop.wait(1.0):
        with contextlib.suppress(TypeError, ValueError):  # a later command's keep-warm
            idle_s = float((read_record(folder) or {}).get("idle_s", idle_s))
        busy = False
        for lease in (folder / "leases").glob("*"):
            if lease.name.isdigit() and _alive(int(lease.name)):
                busy = True
            else:
                with contextlib.suppress(OSError):
                    lease.unlink()
        if busy:
            last_busy = time.monotonic()
        elif time.monotonic() - last_busy >= idle_s:
            print(f"idle for {idle_s:.0f} s", flush=True)
            return
        _keep_spares(folder)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "serve":
        sys.exit(serve(Path(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])))
    print("usage: python -m pipetune.service serve FOLDER IDLE_S PORT", file=sys.stderr)
    sys.exit(2)
