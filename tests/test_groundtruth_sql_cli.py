"""`pipetune groundtruth export|import|list|check|repair` against SQL stores: the real
command in a subprocess where it matters, the exit codes and what a user reads."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

from known import CONV_JOB, DENSE_JOB, noisy

from pipetune.cli import main
from pipetune.groundtruth import GroundTruth
from pipetune.groundtruth.sqlschema import RETRY_ENV
from pipetune.system.config import SystemConfig

CORES2 = SystemConfig(cores=2)
WORKERS1 = SystemConfig(dataloader_workers=1)


def pipetune(*argv: str, home) -> subprocess.CompletedProcess:
    env = {**os.environ, "PIPETUNE_HOME": str(home)}
    env.pop("PIPETUNE_GROUNDTRUTH", None)
    return subprocess.run([sys.executable, "-m", "pipetune", *argv], capture_output=True,
                          text=True, env=env, timeout=120)


def test_export_import_list_through_the_command(tmp_path):
    source = f"sqlite:///{tmp_path / 'source.db'}"
    gt = GroundTruth(source)
    for seed in range(3):
        gt.remember(noisy(CONV_JOB, seed), 32, "time", CORES2, 0.01)
    gt.remember(noisy(DENSE_JOB, 0), 64, "time", WORKERS1, 0.002)
    exported = tmp_path / "export.json"

    out = pipetune("groundtruth", "export", str(exported), "--url", source, home=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"exported 4 records from {source} to {exported}\n"
    assert json.loads(exported.read_text())["records"] == gt._store.read()

    target = f"sqlite:///{tmp_path / 'target.db'}"
    out = pipetune("groundtruth", "import", str(exported), "--path", target, home=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"imported 4 records from {exported} into {target}\n"
    assert GroundTruth(target)._store.read() == gt._store.read()

    out = pipetune("groundtruth", "list", "--path", target, home=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"ground truth at {target}: 4 records, 2 best configs"
    assert "cluster 0: 3 profiles" in lines[1] and "cluster 1: 1 profiles" in lines[2]


def test_the_default_is_a_sqlite_file_in_the_home(tmp_path):
    out = pipetune("groundtruth", "list", home=tmp_path)
    assert out.returncode == 0, out.stderr
    db = tmp_path / "groundtruth.db"
    assert out.stdout == f"ground truth at sqlite:///{db}: 0 records, 0 best configs\n"
    assert db.is_file() and not (tmp_path / "groundtruth.json").exists()


def test_an_import_with_bad_records_is_refused_whole(tmp_path):
    target = f"sqlite:///{tmp_path / 'gt.db'}"
    GroundTruth(target).remember(noisy(CONV_JOB, 0), 32, "time", CORES2, 0.01)
    good = GroundTruth(target)._store.read()[0]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "records": [
        good, {**good, "cost": -1}, good, {**good, "objective": "speed"}]}))
    out = pipetune("groundtruth", "import", str(bad), "--path", target, home=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines() == [
        f"error: {bad}: record 1: cost must be a finite number >= 0, got -1",
        f"error: {bad}: record 3: objective must be one of ('time', 'energy'), got 'speed'",
        f"nothing imported into {target}",
    ]
    assert len(GroundTruth(target)) == 1


def test_bad_input_is_one_error_line_and_exit_2(tmp_path, capsys):
    target = f"sqlite:///{tmp_path / 'gt.db'}"
    cases = [
        (["import", str(tmp_path / "missing.json")], f"{tmp_path / 'missing.json'}: no such"),
        (["import"], "groundtruth import needs a FILE.json"),
        (["export", str(tmp_path / "no" / "dir" / "x.json")], f"{tmp_path / 'no' / 'dir'}"),
        (["list", "extra.json"], "groundtruth list takes no FILE"),
        (["list", "--url", "mysql://u:pw@h/db"], "mysql://u:***@h/db: a ground-truth URL"),
    ]
    for argv, says in cases:
        assert main(["groundtruth", *argv, "--path", target] if "--url" not in argv
                    else ["groundtruth", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err, (argv, err)
        assert len(err.splitlines()) == 1 and "pw" not in err


def test_an_unreachable_server_is_one_line_without_the_password(tmp_path, monkeypatch):
    monkeypatch.setenv(RETRY_ENV, "0")  # no waiting for it (test_groundtruth_pg_restart.py)
    url = "postgresql://pipetune:hunter2@127.0.0.1:1/gt"  # nothing listens on port 1
    out = pipetune("groundtruth", "list", "--url", url, home=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    [line] = out.stderr.splitlines()
    assert line.startswith("error: postgresql+psycopg://pipetune:***@127.0.0.1:1/gt: ")
    assert "hunter2" not in out.stderr + out.stdout


def test_check_and_repair_a_sqlite_store_by_row_id(tmp_path, capsys):
    db = tmp_path / "gt.db"
    url = f"sqlite:///{db}"
    GroundTruth(url).remember(noisy(CONV_JOB, 0), 32, "time", CORES2, 0.01)
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO pipetune_groundtruth_records (id, created_at, record) "
                     "VALUES (7, '2026-01-01', '{\"cost\": 1')")
    assert main(["groundtruth", "check", "--path", url]) == 2
    out = capsys.readouterr()
    assert out.out == f"ground truth at {url}: 2 records, 1 problem(s)\n"
    assert out.err.splitlines()[0].startswith(f"error: {url}: row 7: is not valid JSON")

    assert main(["groundtruth", "repair", "--path", str(db)]) == 0  # a path works too
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"ground truth at {url}: kept 1 records, dropped 1"
    assert lines[1].startswith("  dropped row 7: is not valid JSON")
    [backup] = tmp_path.glob("gt.db.bak-*.json")
    assert lines[2] == f"the table as it was is in {backup}"
    assert main(["groundtruth", "check", "--path", url]) == 0
    assert main(["groundtruth", "clear", "--yes", "--path", url]) == 0
    assert capsys.readouterr().out.endswith(f"removed 1 records from {url}\n")
