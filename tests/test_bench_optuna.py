"""Strategy optuna-plain: a real, tiny in-process Optuna study of a pipetune job."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from known import synthetic_job

from pipetune.bench.optuna_plain import (
    OptunaPlainResult,
    main,
    run_optuna_plain,
    suggest_params,
    trial_seed,
)
from pipetune.space import Choice, IntUniform, LogUniform, Uniform
from pipetune.spec import JobSpec

ROOT = Path(__file__).resolve().parents[1]
MAX_EPOCHS = 3
TRIALS = 4


def tiny_job(*, seed: int = 0, trials: int = TRIALS, metric: str = "accuracy",
             mode: str = "max") -> dict:
    """The synthetic job, without its sleeps, with a three-kind space and ASHA."""
    job = synthetic_job("optuna-plain", seed=seed, trials=trials)
    job["workload"]["params"]["cost_by_knob"] = {}
    job["hyperparameters"] = {
        "lr": {"type": "loguniform", "low": 0.001, "high": 0.5},
        "batch_size": {"type": "choice", "values": [16, 64]},
        "hidden": {"type": "int", "low": 4, "high": 32},
    }
    job["search"]["algorithm"] = "tpe"
    job["early_stopping"] = {
        "policy": "asha", "min_epochs": 1, "max_epochs": MAX_EPOCHS, "reduction_factor": 2,
    }
    job["objective"] = {"metric": metric, "mode": mode, "system": "time"}
    return job


def assert_in_space(params: dict, spec: JobSpec) -> None:
    assert set(params) == set(spec.hyperparameters)
    for name, value in params.items():
        dist = spec.hyperparameters[name]
        if isinstance(dist, Choice):
            assert value in dist.values, (name, value)
        elif isinstance(dist, IntUniform):
            assert isinstance(value, int) and dist.low <= value <= dist.high, (name, value)
        else:
            assert isinstance(value, float) and dist.low <= value <= dist.high, (name, value)


def check_result(r: OptunaPlainResult, spec: JobSpec, trials: int) -> None:
    assert r.trials == trials == len(r.rows)
    assert [row.number for row in r.rows] == list(range(trials))
    assert r.completed + r.pruned + r.failed == trials
    assert r.failed == 0, [row.error for row in r.rows]
    assert r.epochs_run == sum(row.epochs for row in r.rows)
    assert r.epochs_run <= trials * MAX_EPOCHS
    for row in r.rows:
        assert_in_space(row.params, spec)
        assert row.seed == trial_seed(spec, row.number) == spec.search.seed * 100_003 + row.number
        assert row.value is not None and math.isfinite(row.value)
        if row.state == "COMPLETE":
            assert row.epochs == MAX_EPOCHS
        else:
            assert row.state == "PRUNED"
            assert 1 <= row.epochs < MAX_EPOCHS
    done = [row.value for row in r.rows if row.state == "COMPLETE"]
    assert done, "no trial completed"
    pick = max if spec.objective.mode == "max" else min
    assert r.best_value == pick(done)
    best = next(row for row in r.rows if row.number == r.best_trial)
    assert best.state == "COMPLETE" and best.value == r.best_value
    assert r.best_params == best.params
    assert r.process_wall_s >= r.tuning_wall_s > 0
    json.dumps(r.to_dict(), allow_nan=False)
    assert OptunaPlainResult.from_dict(r.to_dict()) == r


def test_sequential_study_prunes_and_trains_the_workload_as_pipetune_does():
    spec = JobSpec.from_dict(tiny_job(seed=0))
    r = run_optuna_plain(spec, n_jobs=1, cores=1)
    check_result(r, spec, TRIALS)
    assert (r.cores, r.n_jobs, r.threads_per_trial) == (1, 1, 1)
    assert r.pruned >= 1 and r.epochs_run < TRIALS * MAX_EPOCHS
    assert r.metric == "accuracy" and r.mode == "max"
    assert r.pruner == "SuccessiveHalving(min_resource=1, reduction_factor=2)"

    # The best trial's value is what the same workload code gives, trained directly
    # with the trial's params and seed for max_epochs epochs under system.default.
    import torch

    torch.set_num_threads(1)
    workload = spec.workload.build()
    workload.setup(r.best_params, trial_seed(spec, r.best_trial))
    for _ in range(MAX_EPOCHS):
        workload.train_epoch(spec.system.default)
    assert workload.evaluate(spec.system.default)["accuracy"] == r.best_value


def test_threaded_study_minimising_val_loss():
    spec = JobSpec.from_dict(tiny_job(seed=3, trials=5, metric="val_loss", mode="min"))
    r = run_optuna_plain(spec, n_jobs=2, cores=2)
    check_result(r, spec, 5)
    assert (r.cores, r.n_jobs) == (2, 2)


def test_default_jobs_are_the_machines_cores():
    from pipetune.system.config import MachineInfo

    spec = JobSpec.from_dict(tiny_job(trials=2))
    r = run_optuna_plain(spec, started=0.0)
    assert r.cores == r.n_jobs == MachineInfo.detect().cores
    assert r.trials == 2
    assert r.process_wall_s > 1e9  # counted from the epoch stamp the caller passed


def test_no_pruning_when_the_job_says_none():
    job = tiny_job(trials=3)
    job["early_stopping"] = {"policy": "none", "max_epochs": 2}
    r = run_optuna_plain(JobSpec.from_dict(job), n_jobs=1)
    assert r.pruner == "none"
    assert (r.completed, r.pruned, r.epochs_run) == (3, 0, 6)


def test_system_knobs_in_the_space_are_refused():
    job = tiny_job()
    job["hyperparameters"]["system.dataloader_workers"] = {"type": "choice", "values": [0, 1]}
    job["pipetune"] = {"enabled": False}
    spec = JobSpec.from_dict(job)
    with pytest.raises(ValueError, match="system.dataloader_workers"):
        run_optuna_plain(spec, n_jobs=1)


def test_every_distribution_maps_to_its_optuna_suggestion():
    import optuna

    space = {
        "u": Uniform(-1.0, 2.0),
        "lu": LogUniform(1e-4, 1e-1),
        "i": IntUniform(2, 5),
        "il": IntUniform(1, 64, log=True),
        "c": Choice(("a", 3, None, True)),
    }
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    seen_choices = set()
    for _ in range(40):
        trial = study.ask()
        params = suggest_params(trial, space)
        assert list(params) == list(space)
        assert isinstance(params["u"], float) and -1.0 <= params["u"] <= 2.0
        assert isinstance(params["lu"], float) and 1e-4 <= params["lu"] <= 1e-1
        assert isinstance(params["i"], int) and 2 <= params["i"] <= 5
        assert isinstance(params["il"], int) and 1 <= params["il"] <= 64
        assert params["c"] in space["c"].values
        seen_choices.add(repr(params["c"]))
        study.tell(trial, 0.0)
    assert seen_choices == {"'a'", "3", "None", "True"}
    dists = study.trials[0].distributions
    assert dists["lu"].log and not dists["u"].log and dists["il"].log
    assert dists["c"].choices == ("a", 3, None, True)


def test_main_in_a_fresh_process_prints_json(tmp_path):
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(JobSpec.from_dict(tiny_job(trials=3)).to_dict()))
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pipetune.bench.optuna_plain", str(job_file),
         "--trials", "2", "--jobs", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert printed == json.loads(out.read_text())
    r = OptunaPlainResult.from_dict(printed)
    assert (r.trials, r.n_jobs, r.strategy) == (2, 1, "optuna-plain")
    assert r.process_wall_s >= r.tuning_wall_s > 0
    assert r.epochs_run == sum(row.epochs for row in r.rows)


def test_main_rejects_a_missing_job(tmp_path, capsys):
    assert main([str(tmp_path / "nope.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_run_subprocess_reads_the_result_back_and_imports_no_orchestration(tmp_path):
    from pipetune.bench.peer_process import run_subprocess

    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(JobSpec.from_dict(tiny_job(trials=2)).to_dict()))
    r = run_subprocess(job_file, n_jobs=1, timeout=120)
    assert (r.trials, r.n_jobs) == (2, 1)
    assert r.process_wall_s >= r.tuning_wall_s > 0

    script = (
        "import json, sys\n"
        "from pipetune.spec import JobSpec\n"
        "from pipetune.bench.optuna_plain import run_optuna_plain\n"
        f"spec = JobSpec.from_dict(json.loads(open({str(job_file)!r}).read()))\n"
        "run_optuna_plain(spec, n_jobs=1, trials=1)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules}"
        " & {'prefect', 'dask', 'distributed', 'mlflow'})))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_run_subprocess_reports_a_failing_child(tmp_path):
    from pipetune.bench.peer_process import run_subprocess

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    with pytest.raises(RuntimeError, match="exit 2"):
        run_subprocess(bad, timeout=120)


def test_the_old_module_name_still_works_with_a_deprecation_warning():
    import importlib

    sys.modules.pop("pipetune.bench_optuna", None)
    with pytest.warns(DeprecationWarning, match="pipetune.bench.optuna_plain"):
        old = importlib.import_module("pipetune.bench_optuna")
    import pipetune.bench.optuna_plain as moved

    assert old is moved and old.run_optuna_plain is moved.run_optuna_plain
    proc = subprocess.run([sys.executable, "-m", "pipetune.bench_optuna", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--trials" in proc.stdout
    assert "deprecated" in proc.stderr and "pipetune.bench.optuna_plain" in proc.stderr
