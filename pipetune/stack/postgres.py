"""A PostgreSQL server of its own, in a folder: ``initdb`` once, then ``pg_ctl`` start/stop.

    pg = Postgres(Path("/srv/stack/postgres")).start()   # port 0: a free port
    pg.create_database("prefect")
    pg.url("prefect", driver="postgresql+asyncpg")  # postgresql+asyncpg://postgres@127.0.0.1:PORT/prefect
    pg.stop()

The binaries come from ``/usr/lib/postgresql/15/bin`` (or ``$PIPETUNE_PG_BIN``), else
from ``PATH``, else the newest ``/usr/lib/postgresql/*/bin``.

Authentication: on a loopback host (127.0.0.1, ::1, localhost) connections from the
loopback address are trusted, no password (a try-it-out stack on one machine). On any
other host every connection, the Unix socket included, needs the superuser's password
(``scram-sha-256``). The password is generated at ``initdb`` and kept in
``<root>/password`` (mode 0600); :meth:`Postgres.url` puts it in the URL when the host
is not loopback.

Running as root: PostgreSQL refuses to run as root, so ``initdb`` and ``pg_ctl`` run as
the ``postgres`` user (``runuser -u postgres --``) and the data folder is chowned to it.
When that user cannot reach ``root`` (an ancestor such as ``/root`` is mode 0700), the
data lives in ``~postgres/pipetune-stacks/<hash of root>`` instead and ``<root>/data``
is a symlink to it.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

from pipetune.dask.address import is_loopback
from pipetune.errors import PipetuneError
from pipetune.net import free_port
from pipetune.stack import _proc

#: Where Debian/Ubuntu put the server binaries (``postgres`` is not on ``PATH`` there).
DEFAULT_BIN = Path("/usr/lib/postgresql/15/bin")
BIN_ENV = "PIPETUNE_PG_BIN"
#: The OS user the server runs as when pipetune runs as root.
OS_USER = "postgres"
SUPERUSER = "postgres"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_WILDCARDS = ("0.0.0.0", "::", "*", "")
#: A Unix socket path must fit in sockaddr_un.sun_path (108 bytes, with the NUL).
_SOCKET_PATH_MAX = 100


def connect_host(host: str) -> str:
    """The address a client on this machine uses to reach a server bound to ``host``."""
    if host in _WILDCARDS:
        return "::1" if host == "::" else "127.0.0.1"
    return host


def find_binary(name: str) -> str:
    """``initdb``, ``pg_ctl``, ``postgres``, ``psql``: the path to run."""
    dirs = [Path(os.environ[BIN_ENV])] if os.environ.get(BIN_ENV) else []
    dirs.append(DEFAULT_BIN)
    for d in dirs:
        if (d / name).is_file():
            return str(d / name)
    found = shutil.which(name)
    if found:
        return found

    def version(p: Path) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", p.parent.name))

    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True):
        if (d / name).is_file():
            return str(d / name)
    raise PipetuneError(
        f"PostgreSQL's `{name}` was not found in {DEFAULT_BIN}, on PATH or in "
        f"/usr/lib/postgresql/*/bin; install PostgreSQL (apt-get install postgresql) or set "
        f"{BIN_ENV} to the folder holding it")


class Postgres:
    """A PostgreSQL server whose files live under ``root``.

    ``port`` 0 picks a free port at :meth:`start`; ``host`` is where it listens
    (``listen_addresses``). The superuser is ``postgres``.
    """

    def __init__(self, root: Path | str, port: int = 0, host: str = "127.0.0.1", *,
                 log_path: Path | str | None = None, start_timeout: float = 60.0):
        self.root = Path(root).expanduser().absolute()
        self.host = host
        self.port = int(port)
        self.log_path = Path(log_path).absolute() if log_path else self.root / "postgres.log"
        self.start_timeout = start_timeout
        self.user = SUPERUSER
        self._area: Path | None = None

    # -- where things are ---------------------------------------------------------------

    @property
    def as_root(self) -> bool:
        return os.geteuid() == 0

    @property
    def data_dir(self) -> Path:
        """The data folder (``<root>/data``, a symlink when the data lives elsewhere)."""
        return self._area_dir() / "data"

    @property
    def password_file(self) -> Path:
        return self.root / "password"

    @property
    def password(self) -> str | None:
        try:
            return self.password_file.read_text().strip() or None
        except OSError:
            return None

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def initialized(self) -> bool:
        return (self.data_dir / "PG_VERSION").is_file()

    @property
    def pid(self) -> int | None:
        """The postmaster's PID while it runs, from ``postmaster.pid``."""
        pid = _proc.read_pid(self.data_dir / "postmaster.pid")
        return pid if _proc.alive(pid) else None

    def running(self) -> bool:
        return self.pid is not None

    def url(self, database: str, driver: str = "postgresql", host: str | None = None) -> str:
        """A SQLAlchemy/libpq URL for ``database`` (``driver``: ``postgresql``,
        ``postgresql+asyncpg``, ``postgresql+psycopg``, ...). ``host`` overrides the
        address written in it (another machine's view of a wildcard bind)."""
        if not self.port:
            raise PipetuneError("PostgreSQL has no port yet: start() it first")
        h = host or connect_host(self.host)
        if ":" in h:
            h = f"[{h}]"
        auth = quote(self.user, safe="")
        if not self.loopback and self.password:
            auth += ":" + quote(self.password, safe="")
        return f"{driver}://{auth}@{h}:{self.port}/{database}"

    # -- life ---------------------------------------------------------------------------

    def start(self) -> Postgres:
        """``initdb`` if the data folder is new, write the settings, start the server and
        wait until it accepts connections."""
        if self.running():
            raise PipetuneError(f"PostgreSQL already runs on {self.data_dir} (pid {self.pid})")
        self.init()
        if not self.port or not _proc.port_free(connect_host(self.host), self.port):
            if self.port:
                raise PipetuneError(f"port {self.port} on {self.host} is taken")
            self.port = free_port(connect_host(self.host))
        self._configure()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # The server inherits this file as its stdout/stderr: no path the postgres
            # user must be able to open.
            done = subprocess.run(
                self._as_pg([find_binary("pg_ctl"), "start", "-D", str(self.data_dir), "-w",
                             "-t", str(int(self.start_timeout)), "-s"]),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self._area_dir(), env=self._env(), start_new_session=True,
            )
        if done.returncode != 0:
            raise PipetuneError(
                f"PostgreSQL did not start (pg_ctl exit {done.returncode}); the end of "
                f"{self.log_path}:\n{_proc.tail(self.log_path)}")
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Fast shutdown (open sessions are ended); SIGKILL after ``timeout``."""
        pid = self.pid
        if pid is None:
            return
        subprocess.run(
            self._as_pg([find_binary("pg_ctl"), "stop", "-D", str(self.data_dir), "-m", "fast",
                         "-w", "-t", str(int(timeout)), "-s"]),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self._area_dir(),
            env=self._env(), check=False,
        )
        _proc.stop(pid, sig=signal.SIGINT, grace=5.0, group=False)

    def init(self) -> None:
        """Create the data folder with ``initdb`` unless it exists."""
        if self.initialized:
            return
        area = self._area_dir()
        if not self.password:
            self.password_file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(24) + "\n")
        pwfile = area / ".initdb-password"
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{self.password}\n")
        self._chown(pwfile)
        try:
            done = subprocess.run(
                self._as_pg([find_binary("initdb"), "-D", str(self.data_dir), "-U", self.user,
                             "-E", "UTF8", "--locale=C", "--auth=scram-sha-256",
                             f"--pwfile={pwfile}"]),
                capture_output=True, text=True, cwd=area, env=self._env(),
            )
        finally:
            pwfile.unlink(missing_ok=True)
        if done.returncode != 0:
            raise PipetuneError(f"initdb failed (exit {done.returncode}) on {self.data_dir}:\n"
                                f"{(done.stdout + done.stderr).strip()[-2000:]}")
        conf = self.data_dir / "postgresql.conf"
        with open(conf, "a") as f:
            f.write("\n# pipetune: listen address, port and socket, rewritten at each start\n"
                    "include_if_exists = 'pipetune.conf'\n")

    def remove(self) -> None:
        """Delete the data (the server must be stopped)."""
        if self.running():
            raise PipetuneError("stop PostgreSQL before removing its data")
        area = self._area_dir()
        if area != self.root:
            shutil.rmtree(area, ignore_errors=True)
            (self.root / "data").unlink(missing_ok=True)
        else:
            shutil.rmtree(self.root / "data", ignore_errors=True)
            shutil.rmtree(self.root / "socket", ignore_errors=True)

    # -- databases ----------------------------------------------------------------------

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run ``sql`` with ``psql`` as the superuser; its unaligned, tuples-only output."""
        done = subprocess.run(
            [find_binary("psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-tA",
             "-h", connect_host(self.host), "-p", str(self.port), "-U", self.user,
             "-d", database, "-c", sql],
            capture_output=True, text=True, env=self._client_env(), stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            raise PipetuneError(f"psql on {database}: {done.stderr.strip() or done.stdout}")
        return done.stdout.strip()

    def create_database(self, name: str) -> bool:
        """Create database ``name`` unless it exists; True if it was created."""
        if not _NAME.match(name):
            raise PipetuneError(f"not a plain database name: {name!r}")
        if self.psql(f"SELECT 1 FROM pg_database WHERE datname = '{name}'") == "1":
            return False
        try:
            self.psql(f'CREATE DATABASE "{name}"')
        except PipetuneError:
            if self.psql(f"SELECT 1 FROM pg_database WHERE datname = '{name}'") == "1":
                return False  # created meanwhile by someone else
            raise
        return True

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.psql("SELECT 1")
                return
            except PipetuneError:
                if time.monotonic() > deadline:
                    raise

    # -- internals ----------------------------------------------------------------------

    def _configure(self) -> None:
        socket_dir = self._area_dir() / "socket"
        if len(str(socket_dir / ".s.PGSQL.65535")) <= _SOCKET_PATH_MAX:
            socket_dir.mkdir(exist_ok=True)
            self._chown(socket_dir)
            os.chmod(socket_dir, 0o700)
            sockets = str(socket_dir)
        else:
            sockets = ""  # TCP only: the folder's path is too long for a socket
        listen = "*" if self.host in ("*", "") else self.host
        self._write(self.data_dir / "pipetune.conf", (
            "# written by pipetune at each start: edit the command line, not this file\n"
            f"listen_addresses = '{listen}'\n"
            f"port = {self.port}\n"
            f"unix_socket_directories = '{sockets}'\n"
            "unix_socket_permissions = 0700\n"
            "password_encryption = 'scram-sha-256'\n"
        ))
        if self.loopback:
            hba = ("local all all trust\n"
                   "host all all 127.0.0.1/32 trust\n"
                   "host all all ::1/128 trust\n")
        else:
            if not self.password:
                raise PipetuneError(
                    f"PostgreSQL on {self.host} needs the superuser's password, and "
                    f"{self.password_file} is missing")
            hba = ("local all all scram-sha-256\n"
                   "host all all 0.0.0.0/0 scram-sha-256\n"
                   "host all all ::/0 scram-sha-256\n")
        self._write(self.data_dir / "pg_hba.conf",
                    "# written by pipetune at each start (see pipetune/stack/postgres.py)\n"
                    "# TYPE DATABASE USER ADDRESS METHOD\n" + hba)

    def _write(self, path: Path, text: str) -> None:
        path.write_text(text)
        os.chmod(path, 0o600)
        self._chown(path)

    def _area_dir(self) -> Path:
        """The folder holding ``data`` and ``socket``: ``root``, or (as root, when the
        postgres user cannot reach ``root``) a folder in that user's home."""
        if self._area is not None:
            return self._area
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.as_root:
            self._area = self.root
            return self._area
        self._os_user()  # fails clearly when the user is missing
        link = self.root / "data"
        if link.is_symlink():
            self._area = Path(os.readlink(link)).parent
            return self._area
        self._chown(self.root)
        if self._pg_can_use(self.root):
            self._area = self.root
            return self._area
        import pwd

        home = Path(pwd.getpwnam(OS_USER).pw_dir)
        base = home if self._pg_can_use(home) else Path("/tmp")
        digest = hashlib.sha256(str(self.root.resolve()).encode()).hexdigest()[:16]
        area = base / "pipetune-stacks" / digest
        area.mkdir(parents=True, exist_ok=True)
        self._chown(area.parent)
        self._chown(area)
        os.chmod(area, 0o700)
        link.symlink_to(area / "data")
        self._area = area
        return area

    def _pg_can_use(self, folder: Path) -> bool:
        done = subprocess.run(["runuser", "-u", OS_USER, "--", "test", "-d", str(folder), "-a",
                               "-w", str(folder), "-a", "-x", str(folder)],
                              cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return done.returncode == 0

    def _os_user(self) -> tuple[int, int]:
        import pwd

        if shutil.which("runuser") is None:
            raise PipetuneError("running as root, PostgreSQL must run as the postgres user, "
                                "and `runuser` is missing")
        try:
            entry = pwd.getpwnam(OS_USER)
        except KeyError:
            raise PipetuneError(
                f"running as root, PostgreSQL must run as another user, and there is no "
                f"`{OS_USER}` user (useradd --system {OS_USER})") from None
        return entry.pw_uid, entry.pw_gid

    def _chown(self, path: Path) -> None:
        if self.as_root:
            uid, gid = self._os_user()
            os.chown(path, uid, gid, follow_symlinks=False)

    def _as_pg(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", OS_USER, "--", *argv] if self.as_root else argv

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.setdefault("LC_ALL", "C.UTF-8")
        return env

    def _client_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        if self.password:
            env["PGPASSWORD"] = self.password
        env["PGCONNECT_TIMEOUT"] = "5"
        return env
