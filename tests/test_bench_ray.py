"""Strategy ray-tune: skipped with one line without Ray, a real tiny Ray Tune run with
it; and the bench job made for short trials under ASHA reduction factor 2."""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SHARED_DATASETS
from known import synthetic_job

from pipetune.bench import PEERS, STRATEGIES, load_bench_job, peer_unavailable, strategy_spec
from pipetune.bench.ray_tune import (
    SKIP_LINE,
    TRIAL_NUMBER,
    RayTuneResult,
    RayTuneUnavailable,
    SearchSpace,
    run_ray_tune,
    run_subprocess,
    trial_seed,
)
from pipetune.spec import JobSpec
from pipetune.system.config import MachineInfo

ROOT = Path(__file__).resolve().parents[1]
MAX_EPOCHS = 2
ASHA2 = ROOT / "benchmarks" / "jobs" / "resnet_mnist_asha2.yaml"


def tiny_job(*, trials: int = 2) -> dict:
    """The synthetic job, without its sleeps, with a three-kind space and ASHA."""
    job = synthetic_job("ray-tune", seed=1, trials=trials)
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
    job["pipetune"] = {"enabled": False}
    return job


def write_job(tmp_path: Path, job: dict) -> Path:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(JobSpec.from_dict(job).to_dict()))
    return path


@pytest.fixture
def no_ray(tmp_path) -> dict[str, str]:
    """An environment whose Python processes cannot import ``ray``, as where it is not
    installed: a ``sitecustomize`` that marks it missing in ``sys.modules``."""
    folder = tmp_path / "no-ray"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        "import sys\nsys.modules['ray'] = None  # import ray: ModuleNotFoundError\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH")) if p)
    return env


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# -- without Ray ----------------------------------------------------------------------------


def test_without_ray_the_runner_says_one_line_and_exits_3(tmp_path, no_ray):
    job = write_job(tmp_path, tiny_job())
    script = (
        "import sys\n"
        "from pipetune.bench import peer_unavailable\n"
        "assert peer_unavailable('optuna-plain') is None\n"
        "print(peer_unavailable('ray-tune'))\n"
        "from pipetune.bench.ray_tune import main\n"
        f"sys.exit(main([{str(job)!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=no_ray, check=False)
    assert proc.returncode == 3, proc.stderr
    assert _lines(proc.stdout) == [SKIP_LINE]
    assert _lines(proc.stderr) == [SKIP_LINE]
    assert SKIP_LINE == ("ray-tune: skipped (Ray Tune is not installed: "
                         "pip install 'pipetune[peers]')")


def test_without_ray_run_subprocess_raises_unavailable(tmp_path, no_ray):
    job = write_job(tmp_path, tiny_job())
    with pytest.raises(RayTuneUnavailable) as caught:
        run_subprocess(job, timeout=120, env=no_ray)
    assert caught.value.line == SKIP_LINE


def test_without_ray_pay_for_itself_skips_it_and_runs_the_others(tmp_path, no_ray):
    job = write_job(tmp_path, tiny_job())
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pay_for_itself.py"), str(job),
         "--skip", "optuna-compiled,pipetune-cold,pipetune-warm"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=no_ray, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert _lines(proc.stderr) == [SKIP_LINE]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["strategy"] for r in rows] == ["optuna-plain"]
    assert rows[0]["epochs"] >= 2 and rows[0]["process_s"] > 0
    table = proc.stdout.split("whole-process seconds per epoch", 1)[1]
    assert "optuna-plain" in table and "ray-tune" not in table


def test_the_space_is_checked_before_ray_is_needed():
    job = tiny_job()
    job["hyperparameters"]["system.dataloader_workers"] = {"type": "choice", "values": [0, 1]}
    with pytest.raises(ValueError, match="system.dataloader_workers"):
        run_ray_tune(JobSpec.from_dict(job), n_jobs=1)


def test_the_search_space_draws_as_optuna_plain_does_and_pickles():
    import optuna

    from pipetune.bench.optuna_plain import suggest_params

    spec = JobSpec.from_dict(tiny_job())
    space = pickle.loads(pickle.dumps(SearchSpace(spec)))  # Tune pickles its searcher
    ours = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=spec.search.seed))
    plain = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=spec.search.seed))
    for number in range(3):
        trial = ours.ask()
        assert space(trial) == {TRIAL_NUMBER: number}
        assert trial.params == suggest_params(plain.ask(), spec.hyperparameters)
        assert list(trial.params) == list(spec.hyperparameters)


# -- the bench job ------------------------------------------------------------------------


def test_asha2_bench_job_has_short_trials_and_one_time_knobs(tmp_path):
    machine = MachineInfo.detect()
    for datasets in (None, tmp_path / "absent"):
        job = load_bench_job(ASHA2, datasets=datasets)
        spec = job.spec
        es = spec.early_stopping
        assert (es.policy, es.min_epochs, es.max_epochs, es.reduction_factor) == (
            "asha", 1, 6, 2)
        assert spec.system.space == {"compile": [False, True], "channels_last": [False, True],
                                     "cores": [1, 2]}
        default = spec.system.default
        assert (default.cores, default.interop_threads, default.dataloader_workers) == (1, 1, 0)
        assert not default.compile and not default.channels_last
        assert (spec.search.algorithm, spec.search.trials, spec.search.seed,
                spec.search.max_concurrent) == ("tpe", 8, 0, 2)
        assert spec.workload.name == "resnet" and spec.pipetune.enabled
        for strategy in STRATEGIES + PEERS:
            strategy_spec(strategy, spec, machine)
    assert "fallback" in job.data and job.spec.workload.params["dataset"] == "digits"
    quick = load_bench_job(ASHA2, quick=True)
    assert (quick.spec.search.trials, quick.spec.early_stopping.max_epochs) == (4, 3)


def test_asha2_bench_job_reads_6000_mnist_digits():
    if not (SHARED_DATASETS / "mnist").is_dir():
        pytest.skip(f"no MNIST under {SHARED_DATASETS}")
    job = load_bench_job(ASHA2, datasets=SHARED_DATASETS)
    params = job.spec.workload.params
    assert (params["dataset"], params["train_samples"], params["val_samples"]) == (
        "idx", 6000, 1000)
    assert params["data_dir"] == str((SHARED_DATASETS / "mnist").resolve())


def test_ray_tune_spec_is_optuna_plains():
    machine = MachineInfo.detect()
    spec = load_bench_job(ASHA2).spec
    ray_spec = strategy_spec("ray-tune", spec, machine)
    assert ray_spec.to_dict() == strategy_spec("optuna-plain", spec, machine).to_dict()
    assert not ray_spec.pipetune.enabled and ray_spec.search.max_concurrent == machine.cores


# -- with Ray -------------------------------------------------------------------------------


def _ray_pids() -> set[int]:
    import psutil

    pids = set()
    for proc in psutil.process_iter(["name", "cmdline"]):
        text = " ".join([proc.info["name"] or "", *(proc.info["cmdline"] or [])])
        if any(mark in text for mark in ("raylet", "gcs_server", "ray::", "/ray/")):
            pids.add(proc.pid)
    return pids


def test_a_real_ray_tune_run_trains_the_workload_as_pipetune_does(tmp_path):
    pytest.importorskip("ray.tune")
    from pipetune.bench.ray_tune import STRATEGY, make_scheduler
    from pipetune.bench.results import result_from_optuna

    assert peer_unavailable("ray-tune") is None
    spec = JobSpec.from_dict(tiny_job(trials=2))
    assert make_scheduler(JobSpec.from_dict({**tiny_job(), "early_stopping": {
        "policy": "none", "max_epochs": 2}})) is None
    before = _ray_pids()
    r = run_subprocess(write_job(tmp_path, tiny_job(trials=2)), timeout=300)

    assert (r.strategy, r.trials, len(r.rows), r.failed) == ("ray-tune", 2, 2, 0), r.rows
    assert [row.number for row in r.rows] == [0, 1]
    assert r.completed + r.pruned == 2 and r.completed >= 1
    assert r.epochs_run == sum(row.epochs for row in r.rows) <= 2 * MAX_EPOCHS
    for row in r.rows:
        assert row.seed == trial_seed(spec, row.number) == 100_003 + row.number
        assert set(row.params) == set(spec.hyperparameters)
        assert row.value is not None and math.isfinite(row.value)
        if row.state == "COMPLETE":
            assert row.epochs == MAX_EPOCHS
        else:
            assert row.state == "PRUNED" and 1 <= row.epochs < MAX_EPOCHS
    assert r.pruner == "ASHA(max_t=2, grace_period=1, reduction_factor=2)"
    assert r.cores == r.n_jobs == MachineInfo.detect().cores and r.threads_per_trial == 1
    assert r.process_wall_s >= r.tuning_wall_s > 0
    assert RayTuneResult.from_dict(json.loads(json.dumps(r.to_dict(), allow_nan=False))) == r
    bench_row = result_from_optuna(r, STRATEGY)
    assert (bench_row.strategy, bench_row.failed, bench_row.epochs_run) == (
        "ray-tune", None, r.epochs_run)
    assert bench_row.process_wall_s == r.process_wall_s

    # The best trial's value is what the same workload code gives, trained directly
    # with the trial's params and seed under system.default on one thread.
    import torch

    torch.set_num_threads(1)
    best = next(row for row in r.rows if row.number == r.best_trial)
    assert best.state == "COMPLETE" and r.best_params == best.params
    workload = spec.workload.build()
    workload.setup(r.best_params, best.seed)
    for _ in range(MAX_EPOCHS):
        workload.train_epoch(spec.system.default)
    assert workload.evaluate(spec.system.default)["accuracy"] == r.best_value

    # Ray's raylet, GCS and trial workers ended with the run.
    deadline = time.monotonic() + 10
    while _ray_pids() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _ray_pids() - before
