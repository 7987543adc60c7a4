"""``pipetune stack up|status|env|down``: the team stack, started for real in a folder.

The end-to-end test starts PostgreSQL, a Prefect server and worker, MLflow and a Dask
scheduler with two workers as detached processes, checks each one, and always stops
them (a fixture runs ``stack down`` even when the test fails).
"""

from __future__ import annotations

import json
import os
import stat
import time
import urllib.request
from pathlib import Path

import pytest
from team import run_stack, skip_without_postgres, stack_folder

from pipetune.cli import main


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` started with."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status


@pytest.fixture
def stack_dir():
    """A fresh stack folder; whatever happens, the stack in it is stopped and its data
    removed at the end."""
    skip_without_postgres(psycopg=True)
    with stack_folder("pipetune-stack-") as directory:
        yield directory


@pytest.mark.slow
def test_stack_up_serves_every_component_and_down_stops_them(stack_dir):
    t0 = time.monotonic()
    up = run_stack("up", "--dir", str(stack_dir), "--workers", "2")
    up_s = time.monotonic() - t0
    assert up.returncode == 0, f"stack up failed:\n{up.stdout}\n{up.stderr}"

    state_file = stack_dir / "stack.json"
    assert stat.S_IMODE(state_file.stat().st_mode) == 0o600
    state = json.loads(state_file.read_text())
    assert state["state"] == "running"
    assert state["host"] == "127.0.0.1"
    names = [c["name"] for c in state["components"]]
    assert names == ["postgres", "prefect-server", "prefect-worker", "mlflow", "dask-scheduler",
                     "dask-worker-w-1", "dask-worker-w-2"]
    for c in state["components"]:
        assert c["pid"] > 0 and c["startup_s"] is not None, c
        assert Path(c["log"]).is_file(), c
        assert int(Path(c["pid_file"]).read_text()) == c["pid"], c
    for key in names + ["work-pool", "total"]:
        assert state["startup_s"][key] >= 0, key
    env = state["env"]
    assert set(env) == {"PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PIPETUNE_DASK_ADDRESS",
                        "PIPETUNE_GROUNDTRUTH", "PIPETUNE_CHECKPOINTS"}
    assert env["PIPETUNE_CHECKPOINTS"] == "mlflow"
    for key, value in env.items():
        assert key == "PIPETUNE_CHECKPOINTS" or "127.0.0.1" in value, (key, value)
        assert f"export {key}={value}" in up.stdout
    assert env["PIPETUNE_GROUNDTRUTH"].startswith("postgresql://")
    assert env["PIPETUNE_GROUNDTRUTH"].endswith("/pipetune")
    assert "password" not in state["postgres"]  # loopback: trusted, no password

    # The health endpoints answer.
    assert _get(f"{env['PREFECT_API_URL']}/health") == 200
    assert _get(f"{env['MLFLOW_TRACKING_URI']}/health") == 200

    # Prefect and MLflow keep their data in PostgreSQL.
    from pipetune.stack import Postgres

    pg = Postgres(stack_dir / "postgres", port=state["postgres"]["port"])
    assert pg.psql("SELECT to_regclass('public.flow')", "prefect") == "flow"
    assert pg.psql("SELECT to_regclass('public.experiments')", "mlflow") == "experiments"
    assert pg.psql("SELECT 1 FROM pg_database WHERE datname = 'pipetune'") == "1"
    pool = json.load(urllib.request.urlopen(
        f"{env['PREFECT_API_URL']}/work_pools/pipetune", timeout=10))
    assert pool["type"] == "process"
    assert pool["concurrency_limit"] == 1 == state["work_pool_concurrency_limit"]
    assert pool["base_job_template"], "the worker gives the pool its job template"

    # The processes that run user code (the Prefect worker, each Dask worker) find the
    # tracking server and keep checkpoints through it.
    for c in state["components"]:
        if c["name"] == "prefect-worker" or c["name"].startswith("dask-worker-"):
            environ = _environ(c["pid"])
            assert environ.get("PIPETUNE_CHECKPOINTS") == "mlflow", c["name"]
            assert environ.get("MLFLOW_TRACKING_URI") == env["MLFLOW_TRACKING_URI"], c["name"]

    # Two Dask workers, each with its cores resource and a home of its own.
    from distributed import Client

    with Client(env["PIPETUNE_DASK_ADDRESS"], timeout=30, set_as_default=False) as client:
        workers = client.scheduler_info(n_workers=-1)["workers"]
        assert sorted(w["name"] for w in workers.values()) == ["w-1", "w-2"]
        assert all(w["resources"] == {"cores": 1} for w in workers.values())
        seen = client.run(lambda: (os.environ["HOME"], os.environ.get("PREFECT_API_URL"),
                                   os.environ.get("MLFLOW_TRACKING_URI"),
                                   os.environ.get("PIPETUNE_CHECKPOINTS"), os.getcwd()))
        # As quiet as the embedded cluster: no profiler sampling each worker every 10 ms.
        import dask

        from pipetune.dask.cluster import QUIET_CLUSTER

        quiet = client.run(lambda: {k: dask.config.get(k) for k in QUIET_CLUSTER})
        on_scheduler = client.run_on_scheduler(
            lambda: dask.config.get("distributed.admin.tick.interval"))
    assert on_scheduler == QUIET_CLUSTER["distributed.admin.tick.interval"]
    assert list(quiet.values()) == [QUIET_CLUSTER] * 2
    homes = [home for home, *_ in seen.values()]
    assert len(set(homes)) == 2
    assert all(Path(h).parent == stack_dir / "workers" for h in homes)
    for home, api, tracking, checkpoints, cwd in seen.values():
        assert api == env["PREFECT_API_URL"] and tracking == env["MLFLOW_TRACKING_URI"]
        assert checkpoints == "mlflow"
        assert cwd == home

    # A second `up` on the same folder is refused; status and env read the stack.
    again = run_stack("up", "--dir", str(stack_dir))
    assert again.returncode == 2
    assert "already running" in again.stderr
    st = run_stack("status", "--dir", str(stack_dir))
    assert st.returncode == 0, st.stdout + st.stderr
    assert st.stdout.count("alive") == 7
    printed = run_stack("env", "--dir", str(stack_dir))
    assert printed.returncode == 0
    assert printed.stdout.splitlines() == [f"export {k}={v}" for k, v in env.items()]
    assert "export PIPETUNE_CHECKPOINTS=mlflow" in printed.stdout.splitlines()

    # Down: every process is gone within 20 s.
    pids = [c["pid"] for c in state["components"]]
    t0 = time.monotonic()
    down = run_stack("down", "--dir", str(stack_dir), timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    deadline = time.monotonic() + 20
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    down_s = time.monotonic() - t0
    assert [p for p in pids if not _gone(p)] == []
    assert json.loads(state_file.read_text())["state"] == "stopped"
    st = run_stack("status", "--dir", str(stack_dir))
    assert st.returncode == 1 and "alive" not in st.stdout
    print(f"\nstack up {up_s:.1f} s (startup_s {state['startup_s']}), down {down_s:.1f} s")


# -- without servers ----------------------------------------------------------------------


def test_status_env_and_down_of_an_empty_folder(tmp_path, capsys):
    assert main(["stack", "status", "--dir", str(tmp_path)]) == 1
    assert "no stack" in capsys.readouterr().out
    assert main(["stack", "env", "--dir", str(tmp_path)]) == 2
    assert "no stack" in capsys.readouterr().err
    assert main(["stack", "down", "--dir", str(tmp_path)]) == 0


def test_up_refuses_bad_sizes(tmp_path, capsys):
    assert main(["stack", "up", "--dir", str(tmp_path), "--workers", "0"]) == 2
    assert "--workers" in capsys.readouterr().err
    assert main(["stack", "up", "--dir", str(tmp_path), "--cores-per-worker", "0"]) == 2


def test_env_lines_quote_for_the_shell():
    from pipetune.stack import env_lines

    state = {"env": {"PIPETUNE_GROUNDTRUTH": "postgresql://postgres:a$b@h:1/pipetune",
                     "PREFECT_API_URL": "http://h:2/api"}}
    assert env_lines(state) == ["export PREFECT_API_URL=http://h:2/api",
                                "export PIPETUNE_GROUNDTRUTH='postgresql://postgres:a$b@h:1/pipetune'"]


def test_the_default_folder_follows_pipetune_home(monkeypatch, tmp_path):
    from pipetune.stack import default_dir

    monkeypatch.setenv("PIPETUNE_HOME", str(tmp_path))
    assert default_dir() == tmp_path / "stack"


def test_up_refuses_half_a_lock_before_starting_anything(tmp_path, monkeypatch, capsys):
    from pipetune.stack.doors import SECRET_ENV

    for name in SECRET_ENV:
        monkeypatch.delenv(name, raising=False)
    up = ["stack", "up", "--dir", str(tmp_path)]
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    assert main(up) == 2
    assert "MLFLOW_TRACKING_PASSWORD" in capsys.readouterr().err
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "too-short")
    assert main(up) == 2
    err = capsys.readouterr().err
    assert "12 characters" in err and "too-short" not in err
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME")
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
    (tmp_path / "ca.pem").write_text("not read here")
    monkeypatch.setenv("PIPETUNE_DASK_TLS_CA_FILE", str(tmp_path / "ca.pem"))
    assert main(up) == 2
    assert "PIPETUNE_DASK_TLS_CERT" in capsys.readouterr().err
    monkeypatch.setenv("PIPETUNE_DASK_TLS_CERT", str(tmp_path / "missing.pem"))
    monkeypatch.setenv("PIPETUNE_DASK_TLS_KEY", str(tmp_path / "ca.pem"))
    assert main(up) == 2
    assert "no such file" in capsys.readouterr().err
    assert not (tmp_path / "stack.json").exists()  # nothing was started


def test_the_locks_keep_their_keys_to_themselves(tmp_path):
    from pipetune.stack.doors import Doors

    for name in ("ca.pem", "s.pem", "s.key"):
        (tmp_path / name).write_text("x")
    doors = Doors.from_env({
        "PREFECT_API_AUTH_STRING": "team:prefect-secret", "MLFLOW_TRACKING_USERNAME": "admin",
        "MLFLOW_TRACKING_PASSWORD": "mlflow-secret-123",
        "PIPETUNE_DASK_TLS_CA_FILE": str(tmp_path / "ca.pem"),
        "PIPETUNE_DASK_TLS_CERT": str(tmp_path / "s.pem"),
        "PIPETUNE_DASK_TLS_KEY": str(tmp_path / "s.key")})
    public = repr(doors) + json.dumps(doors.summary()) + " ".join(doors.dask_args())
    assert "secret" not in public and str(tmp_path / "s.key") in public
    assert doors.scheme == "tls"
    assert doors.client_env()["PREFECT_API_AUTH_STRING"] == "team:prefect-secret"
    assert doors.prefect_headers() == {"Authorization": "Basic dGVhbTpwcmVmZWN0LXNlY3JldA=="}
    server = doors.mlflow_server_env(tmp_path)
    assert server["MLFLOW_AUTH_ADMIN_PASSWORD"] == "mlflow-secret-123"
    assert "secret" not in Path(server["MLFLOW_AUTH_CONFIG_PATH"]).read_text()
    key = tmp_path / "flask-secret-key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert doors.mlflow_server_env(tmp_path)["MLFLOW_FLASK_SERVER_SECRET_KEY"] == \
        key.read_text().strip()  # kept across starts
    assert Doors.from_env({}) == Doors() and Doors().scheme == "tcp"
