"""``pipetune validate``: the real console entry, exit codes and messages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipetune.cli import main
from pipetune.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
LENET = ROOT / "examples" / "lenet_digits.yaml"

BROKEN = """\
name: broken
workload: {name: lenet5}
hyperparameters:
  lr: {type: loguniform, low: 0.001, high: 0.1}
search: {algorithm: tpe, trials: 0}
early_stopping: {max_epochs: 2}
"""


def pipetune(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "pipetune", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_broken_job_exits_2_naming_the_field(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text(BROKEN)
    result = pipetune("validate", str(broken))
    assert result.returncode == 2
    assert f"error: {broken}: search.trials: must be >= 1, got 0" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_missing_file_exits_2(tmp_path):
    result = pipetune("validate", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert "no such file" in result.stderr
    assert "Traceback" not in result.stderr


def test_valid_job_prints_the_resolved_spec():
    result = pipetune("validate", str(LENET))
    assert result.returncode == 0, result.stderr
    (printed,) = list(yaml.safe_load_all(result.stdout))
    assert printed == load_spec(LENET).to_dict()


def test_one_bad_file_among_good_ones_fails_the_run(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BROKEN.replace("trials: 0", "trials: 2").replace("lenet5", "lenet6"))
    assert main(["validate", str(LENET), str(bad), str(LENET)]) == 2
    out, err = capsys.readouterr()
    assert len(list(yaml.safe_load_all(out))) == 2
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: {bad}: workload.name: ")
    assert "lenet6" in err


def test_yaml_syntax_error_reports_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsearch: [1, 2\n")
    assert main(["validate", str(bad)]) == 2
    assert "line " in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--help"], ["validate", "--help"]])
def test_help_does_not_import_torch(args):
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pipetune.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    assert "validate" in result.stdout
    assert "torch" not in result.stderr


def test_version_prints_the_version():
    from pipetune import __version__

    result = pipetune("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"pipetune {__version__} (Python ")


def test_tune_without_a_job_file_exits_2_naming_it():
    for args in (("tune",), ("tune", "--resume"), ("tune", "--resume", "0123abc")):
        result = pipetune(*args)
        assert result.returncode == 2, args
        assert "error: the following arguments are required: JOB.yaml" in result.stderr, args
        assert "Traceback" not in result.stderr
