"""`pipetune groundtruth check` and `repair`: what a user sees, and the exit codes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from known import CONV_JOB, noisy

from pipetune.cli import main
from pipetune.groundtruth import GroundTruth
from pipetune.system.config import SystemConfig

CORES2 = SystemConfig(cores=2)


def _store_with_bad_records(path) -> list[dict]:
    """A store of three records, the last two bad; returns the good one."""
    gt = GroundTruth(path)
    gt.remember(noisy(CONV_JOB, 0), 32, "time", CORES2, 0.01)
    [good] = json.loads(path.read_text())["records"]
    records = [good, {**good, "cost": math.nan}, {**good, "objective": "speed"}]
    path.write_text(json.dumps({"version": 1, "records": records}))
    return [good]


def test_check_a_clean_store_exits_0(tmp_path, capsys):
    path = tmp_path / "gt.json"
    GroundTruth(path).remember(noisy(CONV_JOB, 0), 32, "time", CORES2, 0.01)
    assert main(["groundtruth", "check", "--path", str(path)]) == 0
    out = capsys.readouterr()
    assert out.out == f"ground truth at {path}: 1 records, all valid\n" and out.err == ""


def test_check_a_store_with_bad_records_exits_2_one_line_per_problem(tmp_path, capsys):
    path = tmp_path / "gt.json"
    _store_with_bad_records(path)
    before = path.read_bytes()
    assert main(["groundtruth", "check", "--path", str(path)]) == 2
    out = capsys.readouterr()
    assert out.out == f"ground truth at {path}: 3 records, 2 problem(s)\n"
    assert out.err.splitlines() == [
        f"error: {path}: record 1: cost must be a finite number >= 0, got nan",
        f"error: {path}: record 2: objective must be one of ('time', 'energy'), got 'speed'",
        f"run `pipetune groundtruth repair --path {path}` to keep the valid records and "
        "drop the rest",
    ]
    assert path.read_bytes() == before  # check changes nothing


def test_check_an_unparseable_store_exits_2_without_a_traceback(tmp_path):
    path = tmp_path / "gt.json"
    path.write_text('{"records": [')
    env = {**os.environ, "PIPETUNE_HOME": str(tmp_path / "home")}
    proc = subprocess.run(
        [sys.executable, "-m", "pipetune", "groundtruth", "check", "--path", str(path)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {path}: not a ground-truth file: ")
    assert "Traceback" not in proc.stderr


def test_repair_drops_the_bad_records_then_check_is_clean(tmp_path, capsys):
    path = tmp_path / "gt.json"
    good = _store_with_bad_records(path)
    before = path.read_bytes()
    assert main(["groundtruth", "repair", "--path", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        f"ground truth at {path}: kept 1 records, dropped 2",
        "  dropped record 1: cost must be a finite number >= 0, got nan",
        "  dropped record 2: objective must be one of ('time', 'energy'), got 'speed'",
        f"the file as it was is in {path}.bak",
    ]
    assert json.loads(path.read_text())["records"] == good
    assert (tmp_path / "gt.json.bak").read_bytes() == before
    assert main(["groundtruth", "check", "--path", str(path)]) == 0
    assert main(["groundtruth", "repair", "--path", str(path)]) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_repair_an_unparseable_store_sets_it_aside(tmp_path, capsys):
    path = tmp_path / "gt.json"
    path.write_text("not json")
    assert main(["groundtruth", "repair", "--path", str(path)]) == 0
    out = capsys.readouterr().out
    [aside] = tmp_path.glob("gt.json.corrupt-*")
    assert f"moved it to {aside} and started an empty store" in out
    assert aside.read_text() == "not json"
    assert main(["groundtruth", "list", "--path", str(path)]) == 0
    assert "0 records" in capsys.readouterr().out


def test_a_corrupt_store_stops_list_with_the_repair_command(tmp_path, capsys):
    path = tmp_path / "gt.json"
    _store_with_bad_records(path)
    assert main(["groundtruth", "list", "--path", str(path)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {path}: not a valid ground-truth file (record 1: cost")
    assert f"pipetune groundtruth repair --path {path}" in line
