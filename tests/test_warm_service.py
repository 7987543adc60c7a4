"""The warm local service (pipetune.service), as a user meets it: the first
``pipetune tune`` starts a Prefect server and a Dask cluster that outlive it, the next
commands use them (their flow runs all in that server), a workload edited between two
commands runs as edited, and ``pipetune service stop`` ends them."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml
from known import synthetic_job, tune_env

pytestmark = pytest.mark.slow

WORKLOAD = '''
from pathlib import Path

from pipetune.workloads.synthetic import SyntheticWorkload

VERSION = {version}


class Marked(SyntheticWorkload):
    """The synthetic workload, noting which version of this file ran each epoch."""

    def _before_epoch(self, system, steps):
        with open(Path(__file__).with_name("seen.txt"), "a") as out:
            out.write(f"{{VERSION}}\\n")
        return super()._before_epoch(system, steps)
'''


def _pipetune(tmp_path: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipetune", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


def _seen(tmp_path: Path) -> list[str]:
    seen = tmp_path / "seen.txt"
    lines = seen.read_text().split() if seen.exists() else []
    seen.unlink(missing_ok=True)
    return lines


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left to an init that does not reap is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _left_behind(tmp_path: Path) -> list[str]:
    """Running processes whose command line names this test's service folder."""
    folder = str(tmp_path / "home" / "service")
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and _running(int(proc.name)):
            try:
                args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if folder in args:
                found.append(args)
    return found


def _marks(stdout: str) -> str:
    return re.search(r"^start-up \(s from process start\): (.*)$", stdout, re.M).group(1)


def test_a_warm_service_serves_the_next_commands_with_fresh_code_and_stops(tmp_path):
    env = {**tune_env(tmp_path), "PIPETUNE_KEEP_WARM_S": "120"}
    job = synthetic_job("warm", trials=2)
    job["workload"]["name"] = "marked:Marked"
    job["early_stopping"]["max_epochs"] = 2
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    (tmp_path / "marked.py").write_text(WORKLOAD.format(version=1))
    try:
        first = _pipetune(tmp_path, env, "tune", "job.yaml")
        assert first.returncode == 0, first.stderr[-3000:]
        assert "kept warm for 2 min after the last command" in first.stderr
        assert "Traceback" not in first.stderr and "warning:" not in first.stderr
        assert set(_seen(tmp_path)) == {"1"}
        url = re.search(r"^Prefect: flow runs at (\S+) \(served", first.stdout, re.M).group(1)
        status = _pipetune(tmp_path, env, "service", "status")
        pid = int(re.search(r"^pid (\d+): Prefect (\S+),", status.stdout, re.M).group(1))
        assert url in status.stdout and _running(pid)

        # Edited between two commands: the warm workers that imported it start again.
        time.sleep(0.05)
        (tmp_path / "marked.py").write_text(WORKLOAD.format(version=2))
        second = _pipetune(tmp_path, env, "tune", "job.yaml")
        assert second.returncode == 0, second.stderr[-3000:]
        assert "starting a local Prefect server" not in second.stderr
        assert f"Prefect: flow runs at {url} (served" in second.stdout
        assert set(_seen(tmp_path)) == {"2"}
        assert "workers restarted" in _marks(second.stdout)

        # The newest command's keep-warm time is the service's from now on.
        third = _pipetune(tmp_path, {**env, "PIPETUNE_KEEP_WARM_S": "300"}, "tune", "job.yaml")
        assert third.returncode == 0, third.stderr[-3000:]
        assert set(_seen(tmp_path)) == {"2"}
        assert "workers restarted" not in _marks(third.stdout)
        assert "(served 5 min after the last command" in third.stdout
        assert "stops when idle 300 s" in _pipetune(tmp_path, env, "service", "status").stdout

        # All three studies' flow runs are in the one server, finished.
        request = urllib.request.Request(f"{url}/api/flow_runs/filter", method="POST",
                                         data=b"{}", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            runs = json.load(response)
        assert sorted(r["state_type"] for r in runs) == ["COMPLETED"] * 3
        studies = sorted((tmp_path / "home" / "studies").glob("warm-*"))
        assert {r["name"] for r in runs} == {p.name for p in studies}
    finally:
        stop = _pipetune(tmp_path, env, "service", "stop")
    assert stop.returncode == 0 and "stopped pid" in stop.stdout, stop.stdout + stop.stderr
    assert not _running(pid)
    # Nothing of it is left: its Prefect server, workers, spare recorder.
    deadline = time.monotonic() + 30
    while _left_behind(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _left_behind(tmp_path)
    # nor a socket of a spare, waiting or still warming up
    assert not list((tmp_path / "home" / "service").glob("*/*.sock*"))
    from pipetune.prefect_server import healthy

    assert not healthy(f"{url}/api")
    assert "no warm service runs" in _pipetune(tmp_path, env, "service", "status").stdout


def test_a_bad_keep_warm_value_is_refused_by_name(tmp_path):
    env = {**tune_env(tmp_path), "PIPETUNE_KEEP_WARM_S": "soon"}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(synthetic_job("bad-warm")))
    proc = _pipetune(tmp_path, env, "tune", "job.yaml")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "PIPETUNE_KEEP_WARM_S" in proc.stderr and "seconds >= 0" in proc.stderr
    proc = _pipetune(tmp_path, {**env, "PIPETUNE_KEEP_WARM_S": "0"}, "tune", "job.yaml",
                     "--keep-warm", "-1")
    assert proc.returncode == 2 and "--keep-warm" in proc.stderr, proc.stderr
    assert not (tmp_path / "home" / "service").exists()


def test_a_refused_job_leaves_no_service_behind(tmp_path):
    env = {**tune_env(tmp_path), "PIPETUNE_KEEP_WARM_S": "120"}
    job = synthetic_job("refused")
    job["search"]["trials"] = 0
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    proc = _pipetune(tmp_path, env, "tune", "job.yaml")
    assert proc.returncode == 2 and "search.trials" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "no warm service runs" in _pipetune(tmp_path, env, "service", "status").stdout
    assert not _left_behind(tmp_path)



def _wait_for_spares(tmp_path: Path, env: dict) -> None:
    """Until the service is idle with its spare driver and recorder waiting."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        out = _pipetune(tmp_path, env, "service", "status").stdout
        if "spare driver and recorder waiting" in out and "in use" not in out:
            return
        time.sleep(0.5)
    logs = {p.name: p.read_text()[-2000:]
            for p in (tmp_path / "home" / "service").glob("*/*.log")}
    raise AssertionError(f"the spares never waited: {out}\n{logs}")


def _journal_results(tmp_path: Path) -> int:
    return sum(line.count('"kind": "result"')
               for events in (tmp_path / "home" / "studies").glob("*/events.jsonl")
               for line in events.read_text(errors="replace").splitlines())


def test_a_command_handed_to_the_warm_driver_runs_and_stops_as_its_own(tmp_path):
    """With the service's spare driver waiting, ``tune`` hands itself over: the driver
    runs it on the command's terminal, in its folder, with its environment, and exits
    with it; Ctrl-C on the command stops the study as it would have stopped it."""
    env = {**tune_env(tmp_path), "PIPETUNE_KEEP_WARM_S": "600"}  # outlives the waits below
    job = synthetic_job("handed", trials=1)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    log = tmp_path / "home" / "service"
    try:
        first = _pipetune(tmp_path, env, "tune", "job.yaml")
        assert first.returncode == 0, first.stderr[-3000:]
        _wait_for_spares(tmp_path, env)
        (driver_log,) = log.glob("*/driver.log")

        proc = subprocess.Popen([sys.executable, "-m", "pipetune", "tune", "job.yaml",
                                 "--trials", "2"], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        took = re.search(rf"^pid (\d+) runs `pipetune tune job.yaml --trials 2` for pid "
                         rf"{proc.pid} in {re.escape(str(tmp_path))}$",
                         driver_log.read_text(), re.M)
        assert took, driver_log.read_text()
        assert int(took.group(1)) != proc.pid
        assert "best accuracy:" in out and "start-up (s from process start)" in out
        first_epoch = float(re.search(r"first epoch (\d+\.\d)", out).group(1))
        assert first_epoch < 60  # from the command's own start, not the spare's

        # Ctrl-C on the command: its driver stops the study, the command exits 130.
        job = synthetic_job("handed", trials=6)
        job["workload"]["params"]["base_seconds"] = 3.0
        (tmp_path / "slow.yaml").write_text(yaml.safe_dump(job))
        _wait_for_spares(tmp_path, env)
        before = _journal_results(tmp_path)
        proc = subprocess.Popen([sys.executable, "-m", "pipetune", "tune", "slow.yaml"],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 240
        while _journal_results(tmp_path) < before + 1 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        driver = int(re.findall(r"^pid (\d+) runs `pipetune tune slow.yaml`",
                                driver_log.read_text(), re.M)[-1])
        assert psutil.pid_exists(driver)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err[-3000:]
        assert "interrupted" in err and "Traceback" not in err, err[-3000:]
        deadline = time.monotonic() + 10
        while _running(driver) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(driver)
    finally:
        stop = _pipetune(tmp_path, env, "service", "stop")
    assert stop.returncode == 0, stop.stderr


def test_a_spare_that_exits_before_it_waits_is_named_not_restarted_at_once(tmp_path):
    """A spare that dies while warming up (its log says why) is marked ``<name>.failed``
    for ``pipetune service status``, and is not started again within the minute."""
    from pipetune import service

    spare = service._Spare("driver.sock", "driver.log",
                           ["-c", "import sys; print('cannot warm up'); sys.exit(3)"])
    spare.keep(tmp_path)
    assert spare.procs[-1].wait(timeout=60) == 3
    spare.keep(tmp_path)
    assert (tmp_path / "driver.failed").read_text().startswith("exit code 3")
    assert service._spares_in(tmp_path, "failed") == ["driver"]
    assert len(spare.procs) == 1  # not again at once
    assert "cannot warm up" in (tmp_path / "driver.log").read_text()
    (tmp_path / "driver.sock").touch()  # a later one waits: the mark goes
    spare.keep(tmp_path)
    assert service._spares_in(tmp_path, "failed") == []
