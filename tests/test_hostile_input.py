"""Job files that try to hurt: each is refused with exit 2, one line naming the field
and what is allowed, no traceback, and nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipetune.cli import main

ROOT = Path(__file__).resolve().parents[1]

GOOD = """\
name: hostile
workload: {name: synthetic, params: {train_samples: 64, val_samples: 32}}
hyperparameters:
  lr: {type: loguniform, low: 0.001, high: 0.1}
search: {algorithm: tpe, trials: 2, seed: 0}
early_stopping: {max_epochs: 2}
"""


def replaced(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new)


LAUGHS = "params:\n    a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"    {chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}, *{chr(97 + i)}]\n"
    for i in range(8)
)

CASES = {
    # what: (job text, expected "field: message" fragment)
    "deep nesting in YAML": ("name: x\nworkload: " + "[" * 20000 + "]" * 20000 + "\n",
                             ": nested deeper than 32 levels"),
    "deep nesting in params": (
        replaced("params: {train_samples: 64, val_samples: 32}",
                 "params: {deep: " + "[" * 40 + "]" * 40 + "}"),
        "workload.params.deep." + ".".join(["0"] * 29) + ": nested deeper than 32 levels"),
    "alias expansion (billion laughs)": (
        GOOD.replace("params: {train_samples: 64, val_samples: 32}}",
                     "}\n").replace("workload: {name: synthetic, }",
                                    "workload:\n  name: synthetic\n  " + LAUGHS),
        "values (YAML aliases expand where they are used)"),
    "negative seed": (replaced("seed: 0", "seed: -1"), "search.seed: must be >= 0, got -1"),
    "seed past the searcher's range": (replaced("seed: 0", f"seed: {2**40}"),
                                       "search.seed: must be <= 4294967295"),
    "batch size zero": (
        replaced("  lr: {type: loguniform, low: 0.001, high: 0.1}\n",
                 "  lr: {type: loguniform, low: 0.001, high: 0.1}\n"
                 "  batch_size: {type: choice, values: [0, 32]}\n"),
        "hyperparameters.batch_size: must be > 0, got 0"),
    "negative batch size range": (
        replaced("  lr: {type: loguniform, low: 0.001, high: 0.1}\n",
                 "  lr: {type: loguniform, low: 0.001, high: 0.1}\n"
                 "  batch_size: {type: int, low: -8, high: 32}\n"),
        "hyperparameters.batch_size: must be > 0, got -8"),
    "learning rate of zero in a choice": (
        replaced("lr: {type: loguniform, low: 0.001, high: 0.1}",
                 "lr: {type: choice, values: [0.0, 0.1]}"),
        "hyperparameters.lr: must be > 0, got 0.0"),
    "a huge name": (replaced("name: hostile", "name: " + "n" * 100_000),
                    "name: string should have at most 128 characters"),
    "a huge trial count": (replaced("trials: 2", "trials: 1000000000"),
                           "search.trials: must be <= 100000"),
    "a file too large": (GOOD + "#" + "x" * (1 << 20) + "\n", "larger than 1048576 bytes"),
    "not a mapping": ("- 1\n- 2\n", "a job spec must be a mapping of sections, got [1, 2]"),
}


def _case_ids():
    return list(CASES)


@pytest.mark.parametrize("case", _case_ids())
def test_hostile_job_is_refused_naming_the_field(case, tmp_path, capsys):
    text, expected = CASES[case]
    job = tmp_path / "job.yaml"
    job.write_text(text)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["validate", str(job)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.strip().splitlines()  # one line, no traceback
    assert line.startswith(f"error: {job}: ")
    assert expected in line, line
    assert len(line) < 600
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_the_good_job_of_the_table_is_valid(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(GOOD)
    assert main(["validate", str(job)]) == 0


def test_tune_refuses_a_hostile_job_before_recording_anything(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(CASES["negative seed"][0])
    env = {**os.environ, "PIPETUNE_HOME": str(tmp_path / "home"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", ""))
                                         if p)}
    env.pop("PREFECT_API_URL", None)
    result = subprocess.run([sys.executable, "-m", "pipetune", "tune", str(job)], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "search.seed: must be >= 0, got -1" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "mlruns").exists()


@pytest.mark.parametrize("keep_warm", ["0", "120"])
def test_a_home_that_is_not_a_folder_is_one_line_naming_it(tmp_path, keep_warm):
    """PIPETUNE_HOME naming a file: exit 2, one line, whether or not the command would
    have used (or handed itself to) a warm service."""
    job = tmp_path / "job.yaml"
    job.write_text(GOOD)
    home = tmp_path / "a-file"
    home.write_text("not a folder")
    env = {**os.environ, "PIPETUNE_HOME": str(home), "PIPETUNE_KEEP_WARM_S": keep_warm}
    env.pop("PREFECT_API_URL", None)
    result = subprocess.run([sys.executable, "-m", "pipetune", "tune", str(job)], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"error: PIPETUNE_HOME: {home} cannot be pipetune's home folder" in result.stderr
    assert home.read_text() == "not a folder" and not (tmp_path / "mlflow.db").exists()
