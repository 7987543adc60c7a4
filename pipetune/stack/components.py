"""Launching each component of the stack: its command line, environment, folder and
health check.

A :class:`Launcher` starts one component per method and returns at once with a
:class:`Pending` (PostgreSQL excepted: it is started and waited for); :meth:`Launcher.wait`
then waits for the given ones to be healthy while watching every other launched one,
so each component's ``startup_s`` is its own even when they start side by side.
Every launched process is recorded in ``stack.json`` at once, so a failed or
interrupted start still stops it. The order is :mod:`pipetune.stack.lifecycle`'s.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipetune.dask.address import TLS_ENV, is_loopback
from pipetune.dask.cluster import quiet_env
from pipetune.errors import PipetuneError
from pipetune.net import free_port
from pipetune.prefect_server import RECORDER_SETTINGS
from pipetune.stack import _proc, probes
from pipetune.stack.doors import SECRET_ENV, Doors
from pipetune.stack.postgres import Postgres, connect_host
from pipetune.stack.state import (
    CHECKPOINTS,
    DATABASES,
    ENV_KEYS,
    FORMAT_VERSION,
    WORK_POOL,
    WORK_POOL_CONCURRENCY,
    rank,
    save,
)

_WILDCARDS = ("0.0.0.0", "::", "*", "")


@dataclass(eq=False)
class Pending:
    """A launched component, not yet seen healthy."""

    name: str
    proc: subprocess.Popen
    started: float
    url: str | None
    check: Callable[[], bool]
    healthy_at: float | None = None


class Launcher:
    def __init__(self, directory: Path, host: str, workers: int, cores: int, timeout: float,
                 say: Callable[[str], None], old: dict[str, Any] | None,
                 doors: Doors | None = None):
        self.dir = directory
        self.doors = doors or Doors()
        self.host = host
        self.local = connect_host(host)
        self.public = socket.gethostname() if host in _WILDCARDS else host
        self.workers = workers
        self.cores = cores
        self.timeout = timeout
        self.say = say
        self.old_ports: dict[str, int] = (old or {}).get("ports", {})
        self.logs = directory / "logs"
        self.run_dir = directory / "run"
        self.outstanding: list[Pending] = []
        self.dask_count: probes.DaskCount | None = None
        self.local_env: dict[str, str] = {}
        self.state: dict[str, Any] = {
            "version": FORMAT_VERSION,
            "dir": str(directory),
            "host": host,
            "state": "starting",
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "workers": workers,
            "cores_per_worker": cores,
            "work_pool": WORK_POOL,
            "ports": {},
            "urls": {},
            "env": {},
            "startup_s": {},
            "components": [],
            "doors": self.doors.summary(),
        }

    # ports, addresses, environments

    def port(self, name: str) -> int:
        port = self.old_ports.get(name)
        if port and _proc.port_free(self.local, port):
            return port
        return free_port(self.local)

    def hp(self, host: str, port: int) -> str:
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def addresses(self) -> None:
        p = self.state["ports"]
        pub = self.public
        pg: Postgres = self.pg
        urls = self.state["urls"]
        urls["postgres"] = pg.url("postgres", host=pub)
        urls["prefect_api"] = f"http://{self.hp(pub, p['prefect'])}/api"
        urls["prefect_ui"] = f"http://{self.hp(pub, p['prefect'])}"
        urls["mlflow"] = f"http://{self.hp(pub, p['mlflow'])}"
        scheme = self.doors.scheme
        urls["dask_scheduler"] = f"{scheme}://{self.hp(pub, p['dask-scheduler'])}"
        urls["groundtruth"] = pg.url("pipetune", host=pub)
        self.state["env"] = {
            "PREFECT_API_URL": urls["prefect_api"],
            "MLFLOW_TRACKING_URI": urls["mlflow"],
            "PIPETUNE_DASK_ADDRESS": urls["dask_scheduler"],
            "PIPETUNE_GROUNDTRUTH": urls["groundtruth"],
            "PIPETUNE_CHECKPOINTS": CHECKPOINTS,
        }
        if self.doors.dask_tls:  # paths, no secret: a user's shell needs them too
            tls = {k: v for k, v in self.doors.client_env().items() if k in TLS_ENV.values()}
            self.state["env"].update(tls)
        # What the components themselves use: the local address of each other.
        self.local_env = {
            "PREFECT_API_URL": f"http://{self.hp(self.local, p['prefect'])}/api",
            "MLFLOW_TRACKING_URI": f"http://{self.hp(self.local, p['mlflow'])}",
            "PIPETUNE_DASK_ADDRESS": f"{scheme}://{self.hp(self.local, p['dask-scheduler'])}",
            "PIPETUNE_GROUNDTRUTH": pg.url("pipetune"),
            "PIPETUNE_CHECKPOINTS": CHECKPOINTS,
        }

    def base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ENV_KEYS and k not in SECRET_ENV
               and not k.startswith(("PREFECT_SERVER_DATABASE", "PREFECT_API_DATABASE"))}
        env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
        env["MLFLOW_DISABLE_TELEMETRY"] = "true"
        env["DO_NOT_TRACK"] = "1"
        return env

    def client_env(self) -> dict[str, str]:
        """For the processes that run user code: the stack's addresses and checkpoint
        store, the repository on the import path."""
        env = self.base_env()
        env.update(self.local_env)
        env.update(self.doors.client_env())
        root = repository_root()
        if root is not None:
            parts = [str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
            env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
        return env

    # bookkeeping

    def save(self) -> None:
        self.state["components"].sort(key=rank)  # stable: w-1 before w-2
        save(self.dir, self.state)

    def launch(self, name: str, argv: list[str], env: dict[str, str], url: str | None,
               check: Callable[[], bool], cwd: Path | None = None) -> Pending:
        started = time.monotonic()
        proc = _proc.launch(argv, log=self.logs / f"{name}.log",
                            pid_file=self.run_dir / f"{name}.pid", env=env, cwd=cwd)
        # Recorded at once (url and startup_s filled in when healthy), so a failed or
        # interrupted start still stops it.
        self.state["components"].append({
            "name": name, "pid": proc.pid, "ticks": _proc.start_ticks(proc.pid), "url": None,
            "log": str(self.logs / f"{name}.log"), "pid_file": str(self.run_dir / f"{name}.pid"),
            "startup_s": None, "stop_signal": "SIGTERM", "group": True,
        })
        self.save()
        pending = Pending(name, proc, started, url, check)
        self.outstanding.append(pending)
        return pending

    def wait(self, *targets: Pending) -> None:
        """Until every one of ``targets`` is healthy; meanwhile every other launched
        component is watched too (its exit or time-out fails the start)."""
        while any(t.healthy_at is None for t in targets):
            for p in list(self.outstanding):
                if p.check():
                    self._healthy(p)
                    continue
                log = self.logs / f"{p.name}.log"
                if p.proc.poll() is not None:
                    raise PipetuneError(f"{p.name} exited with code {p.proc.returncode} while "
                                        f"starting; the end of {log}:\n{_proc.tail(log)}")
                if time.monotonic() > p.started + self.timeout:
                    raise PipetuneError(f"{p.name} was not healthy within {self.timeout:.0f} s; "
                                        f"the end of {log}:\n{_proc.tail(log)}")
            if any(t.healthy_at is None for t in targets):
                time.sleep(0.2)

    def _healthy(self, p: Pending) -> None:
        p.healthy_at = time.monotonic()
        self.outstanding.remove(p)
        comp = next(c for c in self.state["components"] if c["pid"] == p.proc.pid)
        comp["url"] = p.url
        comp["startup_s"] = round(p.healthy_at - p.started, 2)
        self.state["startup_s"][p.name] = comp["startup_s"]
        self.save()
        self.say(f"  {p.name:<15} pid {p.proc.pid:<7} {p.url or ''}  "
                 f"({comp['startup_s']:.1f} s)")

    def close(self) -> None:
        if self.dask_count is not None:
            self.dask_count.close()

    # the components

    def postgres(self) -> None:
        """Start PostgreSQL and create the databases: waited for, everything needs it."""
        started = time.monotonic()
        self.say(f"starting the stack in {self.dir} (logs in {self.logs}) ...")
        self.pg = pg = Postgres(self.dir / "postgres", port=self.state["ports"]["postgres"],
                                host=self.host, log_path=self.logs / "postgres.log",
                                start_timeout=self.timeout)
        try:
            pg.start()
        except BaseException:
            with contextlib.suppress(Exception):
                pg.stop()
            raise
        pid = pg.pid or 0
        _proc.write_pid(self.run_dir / "postgres.pid", pid)
        # Fast shutdown (SIGINT): SIGTERM would wait for every client to leave.
        comp = {
            "name": "postgres", "pid": pid, "ticks": _proc.start_ticks(pid),
            "url": f"postgresql://{self.hp(self.public, pg.port)}",
            "log": str(self.logs / "postgres.log"), "pid_file": str(self.run_dir / "postgres.pid"),
            "startup_s": None, "stop_signal": "SIGINT", "group": False,
            "data_dir": str(pg.data_dir),
        }
        self.state["components"].append(comp)
        self.save()
        for db in DATABASES:
            pg.create_database(db)
        self.state["postgres"] = {"port": pg.port, "user": pg.user,
                                  "data_dir": str(pg.data_dir), "databases": list(DATABASES)}
        if not pg.loopback:
            self.state["postgres"]["password"] = pg.password
        comp["startup_s"] = self.state["startup_s"]["postgres"] = round(
            time.monotonic() - started, 2)
        self.save()
        self.say(f"  {'postgres':<15} pid {pid:<7} {comp['url']}  ({comp['startup_s']:.1f} s)")

    def _prefect_home(self) -> Path:
        home = self.dir / "prefect-home"
        home.mkdir(parents=True, exist_ok=True)
        return home

    def prefect_server(self) -> Pending:
        port = self.state["ports"]["prefect"]
        home = self._prefect_home()
        db_url = self.pg.url("prefect", driver="postgresql+asyncpg")
        env = {**RECORDER_SETTINGS, **self.base_env()}
        env.update({
            "PREFECT_HOME": str(home),
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": db_url,
            "PREFECT_API_DATABASE_CONNECTION_URL": db_url,
            "PREFECT_SERVER_API_HOST": self.host,
            "PREFECT_SERVER_API_PORT": str(port),
        })
        if self.doors.prefect_auth:  # the server's own services are clients of its API too
            env["PREFECT_SERVER_API_AUTH_STRING"] = self.doors.prefect_auth
            env["PREFECT_API_AUTH_STRING"] = self.doors.prefect_auth
        if self.host in _WILDCARDS:
            env["PREFECT_UI_API_URL"] = self.state["urls"]["prefect_api"]
        api = self.local_env["PREFECT_API_URL"]
        return self.launch(
            "prefect-server",
            [_executable("prefect"), "server", "start", "--host", self.host, "--port", str(port)],
            env, self.state["urls"]["prefect_api"], lambda: probes.http_ok(f"{api}/health"),
            cwd=home)

    def work_pool(self) -> None:
        """The work pool (type ``process``, at most :data:`WORK_POOL_CONCURRENCY` flow
        runs at once), through the Prefect API: the server must be healthy."""
        started = time.monotonic()
        probes.ensure_work_pool(self.local_env["PREFECT_API_URL"], WORK_POOL, "process",
                                WORK_POOL_CONCURRENCY, headers=self.doors.prefect_headers())
        self.state["work_pool_concurrency_limit"] = WORK_POOL_CONCURRENCY
        self.state["startup_s"]["work-pool"] = round(time.monotonic() - started, 2)
        self.save()
        self.say(f"  {'work pool':<15} {WORK_POOL} (process, concurrency limit "
                 f"{WORK_POOL_CONCURRENCY})  ({self.state['startup_s']['work-pool']:.1f} s)")

    def prefect_worker(self) -> Pending:
        """One process worker on the work pool; healthy once it polls the pool and has
        given it its base job template."""
        folder = self.dir / "prefect-worker"
        folder.mkdir(parents=True, exist_ok=True)
        worker_name = f"stack-{socket.gethostname()}-{os.getpid()}"
        env = self.client_env()
        env["PREFECT_HOME"] = str(self._prefect_home())
        api = self.local_env["PREFECT_API_URL"]
        return self.launch(
            "prefect-worker",
            [_executable("prefect"), "worker", "start", "--pool", WORK_POOL, "--type", "process",
             "--name", worker_name],
            env, f"{WORK_POOL}/{worker_name}",
            lambda: probes.pool_has_worker(api, WORK_POOL, worker_name,
                                           headers=self.doors.prefect_headers()), cwd=folder)

    def mlflow(self) -> Pending:
        port = self.state["ports"]["mlflow"]
        artifacts = self.dir / "mlflow-artifacts"
        artifacts.mkdir(parents=True, exist_ok=True)
        folder = self.dir / "mlflow"
        folder.mkdir(parents=True, exist_ok=True)
        env = self.base_env()
        # MLflow 3's job runner (GenAI scorers, five huey consumer processes): unused here.
        env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
        store = self.pg.url("mlflow", driver="postgresql+psycopg")
        argv = [_executable("mlflow"), "server"]
        auth = self.doors.mlflow_server_env(folder)
        if auth:  # the admin and its password by environment, not on the command line
            env.update(auth)
            argv += ["--app-name", "basic-auth"]
        else:  # its page opens on Model training (one app per server: not with auth)
            from pipetune.tracking.ui_app import model_training_app

            argv += model_training_app()
        if self.pg.password and not self.pg.loopback:
            env["MLFLOW_BACKEND_STORE_URI"] = store  # the password stays out of `ps`
        else:
            argv += ["--backend-store-uri", store]
        argv += ["--serve-artifacts", "--artifacts-destination", str(artifacts),
                 "--host", self.host, "--port", str(port), "--workers", "1"]
        if not is_loopback(self.host):
            hosts = dict.fromkeys([self.public, self.hp(self.public, port), self.local,
                                   self.hp(self.local, port), "localhost",
                                   f"localhost:{port}"])
            argv += ["--allowed-hosts", ",".join(hosts)]
        local = self.local_env["MLFLOW_TRACKING_URI"]
        return self.launch("mlflow", argv, env, self.state["urls"]["mlflow"],
                           lambda: probes.http_ok(f"{local}/health"), cwd=folder)

    def dask_scheduler(self) -> Pending:
        port = self.state["ports"]["dask-scheduler"]
        folder = self.dir / "dask-scheduler"
        folder.mkdir(parents=True, exist_ok=True)
        # The scheduler's HTTP server (health, metrics; the dashboard with bokeh) listens
        # even with --no-dashboard, by default on every address: bind it to the host.
        dash = self.port("dask-dashboard")
        self.state["ports"]["dask-dashboard"] = dash
        argv = [_executable("dask"), "scheduler", "--host", self.host, "--port", str(port),
                "--dashboard-address", self.hp(self.host, dash), *self.doors.dask_args()]
        if _has_bokeh():
            self.state["urls"]["dask_dashboard"] = f"http://{self.hp(self.public, dash)}/status"
        else:
            argv += ["--no-dashboard"]  # bokeh is not installed: no dashboard to serve
        # The driver resends an epoch whose worker died, once; the scheduler must not
        # also retry it (README "Workers that die").
        env = {**quiet_env(), **self.base_env(),
               "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0"}
        return self.launch("dask-scheduler", argv, env,
                           self.state["urls"]["dask_scheduler"],
                           lambda: probes.tcp_ok(self.local, port), cwd=folder)

    def dask_workers(self) -> list[Pending]:
        """The workers, each with a home of its own, as on a machine of its own; the
        scheduler must be healthy."""
        address = self.local_env["PIPETUNE_DASK_ADDRESS"]
        self.dask_count = count = probes.DaskCount(address, self.doors.dask_security())
        pending = []
        for i in range(1, self.workers + 1):
            name = f"w-{i}"
            home = self.dir / "workers" / name
            home.mkdir(parents=True, exist_ok=True)
            env = {**quiet_env(), **self.client_env()}  # the user's DASK_* settings win
            env["HOME"] = str(home)
            env["PREFECT_HOME"] = str(home / ".prefect")
            env.pop("PIPETUNE_HOME", None)
            # One compile cache for every worker of the stack: a trial that moves to
            # another worker, or the next trial of an architecture, reuses its code.
            env.setdefault("PIPETUNE_COMPILE_CACHE", str(self.dir / "compile-cache"))
            # Not daemonic, so an epoch may start data-loader processes
            # (system.dataloader_workers > 0), as on the embedded cluster.
            env["DASK_DISTRIBUTED__WORKER__DAEMON"] = "False"
            # One epoch at a time per worker process (one thread), as on the embedded
            # cluster: torch's thread pools are process-wide, and two epochs setting
            # them from two threads of one process crash it. The epoch's torch threads
            # use the ``cores`` the worker advertises.
            argv = [_executable("dask"), "worker", address, "--nworkers", "1",
                    "--nthreads", "1", "--resources", f"cores={self.cores}",
                    # warmed before it registers (torch imported, first step taken), so
                    # a study's first epoch on it is not measured with that cost
                    "--preload", "pipetune.dask.worker_setup",
                    "--name", name, "--host", self.host, "--local-directory",
                    str(home / "dask-scratch"), "--no-dashboard",
                    # its HTTP server (health, metrics) listens anyway: on the host only
                    "--dashboard-address", self.hp(self.host, 0), *self.doors.dask_args()]
            pending.append(self.launch(
                f"dask-worker-{name}", argv, env,
                f"{name}@{self.state['urls']['dask_scheduler']}",
                lambda name=name: count.has(name), cwd=home))
        return pending


def repository_root() -> Path | None:
    """The folder holding ``flows/`` and ``tasks/`` beside ``pipetune/`` (a source
    checkout or an editable install), for the workers' ``PYTHONPATH``."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "flows").is_dir() and (root / "tasks").is_dir() else None


def _executable(name: str) -> str:
    """The ``prefect``, ``mlflow`` or ``dask`` command of this Python's environment."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


def _has_bokeh() -> bool:
    import importlib.util

    return importlib.util.find_spec("bokeh") is not None
