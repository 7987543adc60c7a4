"""``pipetune bench``: strategies as job-spec transformations, the oracle plan, the
results table and its ratios, the report; one real bench on the synthetic workload."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from pipetune.bench import (
    STRATEGIES,
    BenchResult,
    StrategyResult,
    best_params_overall,
    load_bench_job,
    markdown,
    oracle_rows,
    oracle_spec,
    result_from_study,
    strategy_spec,
    system_axes,
    write_report,
)
from pipetune.checkpoints import CheckpointStore
from pipetune.engine.study import Study, run_study_locally
from pipetune.errors import SpecError
from pipetune.groundtruth import GroundTruth
from pipetune.searchers import make_searcher
from pipetune.spec import JobSpec
from pipetune.system.config import MachineInfo, SystemConfig

MACHINE = MachineInfo(cores=2)
REPO = Path(__file__).resolve().parents[1]

# interop_threads=1 costs 0.04 s per epoch, so the fastest config has interop 2.
JOB = {
    "name": "bench-test",
    "workload": {
        "name": "synthetic",
        "params": {"train_samples": 64, "val_samples": 32,
                   "cost_by_knob": {"interop_threads": {"1": 0.04}}},
    },
    "hyperparameters": {"lr": {"type": "loguniform", "low": 0.01, "high": 0.1},
                        "hidden": {"type": "choice", "values": [8, 16]}},
    "system": {"default": {"cores": 1, "interop_threads": 1, "dataloader_workers": 0},
               "space": {"interop_threads": [1, 2]}},
    "search": {"algorithm": "random", "trials": 3, "seed": 3, "max_concurrent": 2},
    "early_stopping": {"policy": "none", "max_epochs": 3},
    "objective": {"metric": "accuracy", "mode": "max", "system": "time"},
}


@pytest.fixture(scope="module")
def base() -> JobSpec:
    return JobSpec.from_dict(JOB, machine=MACHINE)


# -- strategies ---------------------------------------------------------------------------


def test_v1_strategies_fix_the_system_config_and_turn_pipetune_off(base):
    v1 = strategy_spec("v1-default", base, MACHINE)
    assert not v1.pipetune.enabled
    assert v1.system.default == SystemConfig(cores=2)
    assert v1.search.max_concurrent == 1
    one = strategy_spec("v1-one-core", base, MACHINE)
    assert not one.pipetune.enabled
    assert one.system.default == SystemConfig(cores=1)
    assert one.search.max_concurrent == 2
    for spec in (v1, one):  # same budget, seeds and space as the job
        assert spec.search.trials == base.search.trials
        assert spec.search.seed == base.search.seed
        assert spec.hyperparameters == base.hyperparameters


def test_v2_adds_every_system_knob_of_the_space_to_the_hyperparameters(base):
    v2 = strategy_spec("v2", base, MACHINE)
    assert not v2.pipetune.enabled
    assert v2.hyperparameters["system.interop_threads"].values == (1, 2)
    assert "system.cores" not in v2.hyperparameters  # cores is not in the job's space
    assert {k: v for k, v in v2.hyperparameters.items() if not k.startswith("system.")} \
        == base.hyperparameters


def test_pipetune_strategies_run_the_job_as_written(base):
    off = JobSpec.from_dict({**JOB, "pipetune": {"enabled": False}}, machine=MACHINE)
    for name in ("pipetune-cold", "pipetune-warm"):
        spec = strategy_spec(name, off, MACHINE)
        assert spec.pipetune.enabled
        assert spec.system == base.system


def test_an_unknown_strategy_is_a_spec_error(base):
    with pytest.raises(SpecError) as e:
        strategy_spec("v3", base, MACHINE)
    assert e.value.field == "strategy" and "pipetune-cold" in str(e.value)


def test_oracle_plan_is_every_system_config_for_one_param_set(base):
    params = {"lr": 0.05, "hidden": 16, "system.interop_threads": 2}
    spec = oracle_spec(base, params, MACHINE)
    assert system_axes(base, MACHINE) == {"cores": [1, 2], "interop_threads": [1, 2]}
    assert spec.search.algorithm == "grid" and spec.search.max_concurrent == 1
    assert spec.early_stopping.policy == "none" and spec.early_stopping.max_epochs == 3
    searcher = make_searcher("grid", spec.hyperparameters, seed=0)
    planned = []
    while (s := searcher.ask()) is not None:
        planned.append(s.params)
    assert len(planned) == spec.search.trials == 4
    assert all(p["lr"] == 0.05 and p["hidden"] == 16 for p in planned)
    assert {(p["system.cores"], p["system.interop_threads"]) for p in planned} == {
        (1, 1), (1, 2), (2, 1), (2, 2)}


# -- bench job files ----------------------------------------------------------------------


def _job_file(tmp_path: Path, bench: dict, params: dict) -> Path:
    data = {**JOB, "bench": bench, "workload": {"name": "textcnn", "params": params},
            "hyperparameters": {"lr": {"type": "loguniform", "low": 0.001, "high": 0.01}}}
    path = tmp_path / "jobs" / "job.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def test_relative_data_paths_resolve_against_the_data_root(tmp_path, monkeypatch):
    monkeypatch.delenv("PIPETUNE_DATASETS", raising=False)
    csv = tmp_path / "data" / "ag_news" / "test.csv"
    csv.parent.mkdir(parents=True)
    csv.write_text("label,title,description\n1,a,b\n")
    path = _job_file(tmp_path, {"datasets": "../data", "fallback": {"dataset": "bundled"}},
                     {"dataset": "ag_news", "path": "ag_news/test.csv"})
    job = load_bench_job(path, machine=MACHINE)
    assert job.spec.workload.params["path"] == str(csv)
    assert "fallback" not in job.data and str(csv) in job.data
    monkeypatch.setenv("PIPETUNE_DATASETS", str(tmp_path / "elsewhere"))
    moved = load_bench_job(path, machine=MACHINE)
    assert moved.spec.workload.params == {"dataset": "bundled"}
    assert "fallback" in moved.data


def test_missing_data_falls_back_to_the_embedded_dataset(tmp_path):
    path = _job_file(
        tmp_path, {"datasets": "../nowhere",
                   "fallback": {"dataset": "bundled", "train_samples": 100}},
        {"dataset": "ag_news", "path": "ag_news/test.csv", "max_len": 20})
    job = load_bench_job(path, machine=MACHINE)
    assert job.spec.workload.params == {"dataset": "bundled", "train_samples": 100,
                                        "max_len": 20}
    assert "ag_news/test.csv not found" in job.data


def test_missing_data_without_a_fallback_names_the_field(tmp_path):
    path = _job_file(tmp_path, {"datasets": "../nowhere"},
                     {"dataset": "ag_news", "path": "ag_news/test.csv"})
    with pytest.raises(SpecError) as e:
        load_bench_job(path, machine=MACHINE)
    assert e.value.field == "workload.params.path"


def test_unknown_bench_fields_are_spec_errors(tmp_path):
    path = _job_file(tmp_path, {"dataset": "x"}, {"dataset": "bundled"})
    with pytest.raises(SpecError) as e:
        load_bench_job(path, machine=MACHINE)
    assert e.value.field == "bench.dataset"
    path = _job_file(tmp_path, {"quick": {"epochs": 2}}, {"dataset": "bundled"})
    with pytest.raises(SpecError) as e:
        load_bench_job(path, quick=True, machine=MACHINE)
    assert e.value.field == "bench.quick.epochs"


def test_quick_applies_the_quick_section(tmp_path):
    path = _job_file(tmp_path, {"quick": {"trials": 2, "max_epochs": 2,
                                          "workload_params": {"train_samples": 50}}},
                     {"dataset": "bundled", "train_samples": 400})
    full, quick = load_bench_job(path, machine=MACHINE), load_bench_job(path, quick=True,
                                                                        machine=MACHINE)
    assert (full.spec.search.trials, full.spec.early_stopping.max_epochs) == (3, 3)
    assert (quick.spec.search.trials, quick.spec.early_stopping.max_epochs) == (2, 2)
    assert quick.spec.workload.params["train_samples"] == 50 and quick.quick


@pytest.mark.parametrize("name", ["lenet_mnist.yaml", "textcnn_agnews.yaml"])
def test_shipped_bench_jobs_are_valid_and_sized(name, tmp_path):
    path = REPO / "benchmarks" / "jobs" / name
    for datasets in (None, tmp_path / "absent"):
        job = load_bench_job(path, datasets=datasets)
        assert job.spec.search.trials >= 8 and job.spec.early_stopping.max_epochs >= 3
        assert job.spec.pipetune.enabled
        for strategy in STRATEGIES:
            strategy_spec(strategy, job.spec, MachineInfo.detect())
    assert "fallback" in job.data


# -- results and report -------------------------------------------------------------------


def _run(spec: JobSpec, tmp_path: Path, gt: GroundTruth | None = None) -> Study:
    study = Study(spec, study_id=f"s-{len(list(tmp_path.iterdir()))}",
                  checkpoints=CheckpointStore(str(tmp_path / "ckpt")), ground_truth=gt,
                  core_budget=2, machine=MACHINE)
    return run_study_locally(study)


@pytest.fixture(scope="module")
def bench(base, tmp_path_factory) -> BenchResult:
    tmp = tmp_path_factory.mktemp("bench")
    gt = GroundTruth(str(tmp / "gt.json"))
    results = []
    for i, name in enumerate(("v1-default", "pipetune-cold")):
        spec = strategy_spec(name, base, MACHINE)
        study = _run(spec, tmp, gt if spec.pipetune.enabled else None)
        results.append(result_from_study(name, study, wall_s=10.0 + 10 * i,
                                         study_run_id=f"run-{i}"))
    params = best_params_overall(results, "max")
    oracle = _run(oracle_spec(base, params, MACHINE), tmp)
    return BenchResult(
        job="bench-test", metric="accuracy", mode="max", data="blobs", quick=True,
        machine="test", command="pipetune bench job.yaml", date="today", strategies=results,
        oracle=oracle_rows(oracle), oracle_params=params,
    )


def test_results_come_from_the_studies(bench):
    v1, cold = bench.get("v1-default"), bench.get("pipetune-cold")
    assert v1.epochs_run == cold.epochs_run == 9
    assert v1.probe_epochs == 0 and cold.probe_epochs >= 1
    assert v1.chosen_system == "cores=2 interop=1 workers=0"
    assert cold.energy_source == "estimate" and cold.energy_j > 0
    assert 0.0 <= cold.overhead_share < 1.0


def test_oracle_rows_rank_the_planted_fastest_config_first(bench):
    assert len(bench.oracle) == 4
    assert [o.train_s for o in bench.oracle] == sorted(o.train_s for o in bench.oracle)
    assert "interop=2" in bench.oracle[0].system  # interop 1 sleeps 0.04 s per epoch


def test_ratios_are_against_v1_default_and_the_oracle(bench):
    rows = {r["strategy"]: r for r in bench.table()}
    assert rows["v1-default"]["tuning_vs_v1"] == 1.0
    assert rows["pipetune-cold"]["tuning_vs_v1"] == pytest.approx(20.0 / 10.0)
    train = bench.training_s("pipetune-cold")
    assert train is not None
    assert rows["pipetune-cold"]["train_vs_oracle"] == pytest.approx(train / bench.oracle_best_s)
    assert rows["pipetune-cold"]["train_vs_v1"] == pytest.approx(
        train / bench.training_s("v1-default"))
    targets = {t["target"]: t for t in bench.targets()}
    cold_time = targets["pipetune-cold tuning time <= 0.85 x v1-default"]
    assert cold_time["met"] == "NO" and cold_time["measured"] == "2.00 x"


def test_the_headline_ratio_is_against_optuna_plain(bench):
    from pipetune.bench import result_from_optuna
    from pipetune.bench.optuna_plain import OptunaPlainResult

    plain = OptunaPlainResult(
        job="bench-test", metric="accuracy", mode="max", tuning_wall_s=25.0,
        process_wall_s=28.0, best_value=0.9, best_params={"lr": 0.1}, best_trial=0,
        trials=3, completed=3, pruned=0, failed=0, epochs_run=9, max_epochs=3, cores=2,
        n_jobs=2)
    other = BenchResult(**{**bench.__dict__, "optuna_target": 0.9,
                           "strategies": [result_from_optuna(plain), *bench.strategies]})
    rows = {r["strategy"]: r for r in other.table()}
    assert rows["optuna-plain"]["process_wall_s"] == 28.0
    assert rows["pipetune-cold"]["tuning_vs_optuna"] == pytest.approx(20.0 / 25.0)
    target = {t["target"]: t for t in other.targets()}[
        "PipeTune cold tuning time <= 0.9 x optuna-plain"]
    assert target["met"] == "yes" and target["measured"] == "0.80 x"
    assert "| optuna-plain | 25.0 | 28.0 | 1.00 |" in markdown(other)


def test_a_strategy_missing_from_the_oracle_has_no_ratio(bench):
    lost = StrategyResult(**{**bench.get("v1-default").__dict__, "strategy": "v2",
                             "chosen_system": "cores=9 interop=1 workers=0"})
    other = BenchResult(**{**bench.__dict__, "strategies": [*bench.strategies, lost]})
    row = next(r for r in other.table() if r["strategy"] == "v2")
    assert row["train_s"] is None and math.isnan(row["train_vs_oracle"])


def test_report_writes_markdown_json_and_pictures(bench, tmp_path):
    paths = write_report(bench, tmp_path / "out")
    text = paths["markdown"].read_text()
    assert text == markdown(bench)
    for name in ("v1-default", "pipetune-cold", "| target | measured | met |"):
        assert name in text
    data = json.loads(paths["json"].read_text())
    assert [r["strategy"] for r in data["table"]] == ["v1-default", "pipetune-cold"]
    for kind in ("tuning_time", "metric_vs_time"):
        assert paths[kind].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_an_unknown_strategy_before_starting_anything(capsys):
    from pipetune.cli import main

    code = main(["bench", str(REPO / "benchmarks/jobs/lenet_mnist.yaml"), "--strategies", "v9"])
    assert code == 2
    assert "--strategies" in capsys.readouterr().err


# -- one real bench -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_real_bench_on_prefect_dask_and_mlflow(prefect_api_url, tmp_path):
    import dask
    from distributed import LocalCluster
    from mlflow.tracking import MlflowClient

    from flows.bench import run_bench
    from pipetune.bench import BenchJob
    from pipetune.tracking import ensure_experiment

    job = {**JOB, "search": {**JOB["search"], "trials": 2}}
    spec = JobSpec.from_dict(job)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ensure_experiment(uri)
    with dask.config.set({"distributed.worker.daemon": False}):
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                               resources={"cores": 2}, host="127.0.0.1", dashboard_address=None)
    try:
        result, paths = run_bench(
            BenchJob(spec=spec, path="job.yaml", data="blobs", quick=True),
            out_dir=tmp_path / "out", tracking_uri=uri, command="test",
            dask_address=cluster.scheduler_address,
        )
    finally:
        cluster.close()
    assert [s.strategy for s in result.strategies] == list(STRATEGIES)
    assert len(result.oracle) == 4
    warm = result.get("pipetune-warm")
    assert warm.groundtruth_hits == 2 and warm.probe_epochs == 0
    client = MlflowClient(uri)
    parent = client.get_run(result.bench_run_id)
    assert parent.info.status == "FINISHED"
    assert "pipetune-cold.tuning_vs_v1" in parent.data.metrics
    kids = client.search_runs([parent.info.experiment_id],
                              f"tags.mlflow.parentRunId = '{result.bench_run_id}'")
    assert {k.data.tags["pipetune.strategy"] for k in kids} == set(STRATEGIES)
    plain = result.get("optuna-plain")
    assert plain.epochs_run >= 2 and plain.process_wall_s > plain.tuning_wall_s > 0
    compiled = result.get("optuna-compiled")
    assert compiled.epochs_run >= 2 and compiled.process_wall_s > compiled.tuning_wall_s > 0
    assert (tmp_path / "out" / "compile-cache-optuna-compiled").is_dir()  # its own cache
    for kid in kids:
        if kid.data.tags["pipetune.strategy"] in ("optuna-plain", "optuna-compiled"):
            assert "pipetune.study_run_id" not in kid.data.tags  # no study flow behind it
            continue
        study_run = client.get_run(kid.data.tags["pipetune.study_run_id"])
        assert study_run.data.tags["pipetune.bench_run_id"] == result.bench_run_id
    assert paths["markdown"].exists()


def test_the_oracle_is_also_read_by_core_seconds_and_per_epoch_against_optuna(bench):
    import dataclasses

    from pipetune.bench import OracleRow, result_from_optuna
    from pipetune.bench.optuna_plain import OptunaPlainResult

    cold = bench.get("pipetune-cold")
    chosen = OracleRow(system=cold.chosen_system, train_s=36.9, epoch_s=4.1, energy_j=1.0,
                       value=0.9, cores=1)
    wide = OracleRow(system="cores=2 wide", train_s=27.4, epoch_s=3.0, energy_j=1.0,
                     value=0.9, cores=2)
    plain = OptunaPlainResult(
        job="bench-test", metric="accuracy", mode="max", tuning_wall_s=25.0,
        process_wall_s=30.0, best_value=0.9, best_params={"lr": 0.1}, best_trial=0,
        trials=3, completed=3, pruned=0, failed=0, epochs_run=10, max_epochs=3, cores=2,
        n_jobs=2)
    compiled = dataclasses.replace(result_from_optuna(plain, "optuna-compiled"),
                                   process_wall_s=40.0)
    mine = dataclasses.replace(cold, process_wall_s=27.0, epochs_run=9)
    other = BenchResult(**{**bench.__dict__, "oracle": [wide, chosen],
                           "strategies": [result_from_optuna(plain), compiled, mine]})
    targets = {t["target"]: t for t in other.targets()}
    # Alone on an idle machine the 2-core config is faster; per core it is dearer.
    assert targets["pipetune-cold chosen config within 5% of the oracle"]["met"] == "NO"
    by_cores = targets["pipetune-cold chosen config within 5% of the oracle by core-seconds"]
    assert by_cores["met"] == "yes" and by_cores["measured"].startswith("1.000 x")
    # 27 s / 9 epochs against the better of 30 s / 10 and 40 s / 10.
    per_epoch = targets["pipetune-cold s/epoch <= 1 x the better of optuna-plain and "
                        "optuna-compiled"]
    assert per_epoch["measured"] == "1.00 x" and per_epoch["met"] == "yes"
    rows = {r["strategy"]: r for r in other.table()}
    assert rows["optuna-compiled"]["process_s_per_epoch"] == pytest.approx(4.0)


# -- a strategy that fails --------------------------------------------------------------------


def test_a_failed_strategy_is_reported_and_left_out_of_every_ratio(bench, tmp_path):
    import dataclasses

    from pipetune.bench import result_from_optuna
    from pipetune.bench.optuna_plain import OptunaPlainResult

    plain = OptunaPlainResult(
        job="bench-test", metric="accuracy", mode="max", tuning_wall_s=25.0,
        process_wall_s=30.0, best_value=0.9, best_params={"lr": 0.1}, best_trial=0,
        trials=3, completed=3, pruned=0, failed=0, epochs_run=9, max_epochs=3, cores=2,
        n_jobs=2)
    cold = dataclasses.replace(bench.get("pipetune-cold"), process_wall_s=27.0)
    warm = StrategyResult.failure("pipetune-warm", "workload w is broken: 3 trials failed "
                                  "with RuntimeError: boom | x\n  (see traceback.txt)")
    assert warm.failed == ("workload w is broken: 3 trials failed with RuntimeError: boom | x "
                           "(see traceback.txt)")  # one line
    v1 = StrategyResult.failure("v1-default", "SpecError: system.default.cores: too many")
    other = BenchResult(**{**bench.__dict__, "strategies": [
        result_from_optuna(plain), v1, cold, warm]})
    assert [s.strategy for s in other.failed] == ["v1-default", "pipetune-warm"]
    rows = {r["strategy"]: r for r in other.table()}
    assert rows["pipetune-warm"]["failed"] == warm.failed
    assert rows["pipetune-cold"]["failed"] is None
    assert math.isnan(rows["pipetune-warm"]["tuning_vs_optuna"])
    assert rows["pipetune-cold"]["tuning_vs_optuna"] == pytest.approx(20.0 / 25.0)
    assert math.isnan(rows["pipetune-cold"]["tuning_vs_v1"])  # its reference failed
    assert rows["pipetune-cold"]["train_vs_v1"] is not None
    assert math.isnan(rows["pipetune-cold"]["train_vs_v1"])
    targets = {t["target"]: t for t in other.targets()}
    assert targets["pipetune-cold tuning time <= 0.85 x v1-default"] == {
        "target": "pipetune-cold tuning time <= 0.85 x v1-default",
        "measured": "v1-default failed", "met": "n/a"}
    assert targets["PipeTune warm <= 0.9 x PipeTune cold"]["met"] == "n/a"
    assert targets["pipetune-warm chosen config within 5% of the oracle"]["measured"] \
        == "pipetune-warm failed"
    assert targets["PipeTune cold tuning time <= 1.05 x optuna-plain"]["met"] == "yes"
    text = markdown(other)
    assert "| pipetune-warm (FAILED) | - | - | - |" in text
    assert f"- pipetune-warm FAILED: {warm.failed}" in text
    assert "- v1-default FAILED: SpecError: system.default.cores: too many" in text
    paths = write_report(other, tmp_path / "out")  # the figures draw it too
    data = json.loads(paths["json"].read_text())
    assert [s["failed"] for s in data["strategies"]] == [None, v1.failed, None, warm.failed]
    assert paths["tuning_time"].read_bytes()[:4] == b"\x89PNG"


def test_when_every_optuna_strategy_failed_its_ratios_are_na(bench):
    from pipetune.bench import result_from_optuna
    from pipetune.bench.optuna_plain import OptunaPlainResult, OptunaTrialRow

    rows = [OptunaTrialRow(number=i, params={}, epochs=0, value=None, state="FAIL", seed=i,
                           error="RuntimeError: synthetic workload: planned failure at epoch 1")
            for i in range(3)]
    every_trial_failed = OptunaPlainResult(
        job="bench-test", metric="accuracy", mode="max", tuning_wall_s=1.0,
        process_wall_s=3.0, best_value=None, best_params=None, best_trial=None, trials=3,
        completed=0, pruned=0, failed=3, epochs_run=0, max_epochs=3, cores=2, n_jobs=2,
        rows=rows)
    plain = result_from_optuna(every_trial_failed)
    assert plain.failed == ("all 3 trials failed: RuntimeError: synthetic workload: planned "
                            "failure at epoch 1")
    compiled = StrategyResult.failure("optuna-compiled", "the Optuna process exited 1: "
                                      "ZeroDivisionError: division by zero")
    cold = bench.get("pipetune-cold")
    other = BenchResult(**{**bench.__dict__, "strategies": [plain, compiled, cold]})
    assert other.optuna_best_per_epoch is None
    row = {r["strategy"]: r for r in other.table()}["pipetune-cold"]
    assert math.isnan(row["tuning_vs_optuna"]) and math.isnan(row["per_epoch_vs_optuna_best"])
    targets = {t["target"]: t for t in other.targets()}
    assert targets["PipeTune cold tuning time <= 1.05 x optuna-plain"]["met"] == "n/a"
    per_epoch = targets["pipetune-cold s/epoch <= 1 x the better of optuna-plain and "
                        "optuna-compiled"]
    assert per_epoch == {"target": per_epoch["target"], "met": "n/a",
                         "measured": "optuna-plain and optuna-compiled failed"}
    assert "| pipetune-cold | 20.0 |" in markdown(other)


def test_a_failed_optuna_child_gives_the_line_naming_its_exception(tmp_path):
    from pipetune.bench.peer_process import OptunaRunFailed, failure_line, run_subprocess

    traceback = ("[W 2026-12-05] Trial 0 failed\nTraceback (most recent call last):\n"
                 '  File "x.py", line 3, in f\n    1 / 0\n'
                 "ZeroDivisionError: division by zero\n\n")
    assert failure_line(traceback) == "ZeroDivisionError: division by zero"
    assert failure_line("a\nmod.sub.BrokenThing: x y\nsome log line\n") == \
        "mod.sub.BrokenThing: x y"
    assert failure_line("just a line\n") == "just a line"
    assert failure_line("") == "nothing on stderr"
    assert len(failure_line("ValueError: " + "x" * 1000)) == 300
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    with pytest.raises(OptunaRunFailed) as e:
        run_subprocess(bad, timeout=120)
    assert e.value.exit_code == 2
    assert e.value.reason.startswith("optuna-plain: ") and "\n" not in e.value.reason
    assert isinstance(e.value, RuntimeError)  # as before


@pytest.mark.slow
def test_a_bench_reports_failed_strategies_and_goes_on(prefect_api_url, tmp_path):
    """A workload that raises in its first epoch, through the real command (its own
    process: the embedded cluster it starts must not outlive it here): pipetune stops on
    the broken workload, every Optuna trial fails; both are reported failed and the
    command exits 1 with the report written."""
    import os
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    job = {**JOB, "search": {**JOB["search"], "trials": 3},
           "workload": {"name": "synthetic",
                        "params": {**JOB["workload"]["params"], "fail_at_epoch": 1}}}
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(job))
    out = tmp_path / "out"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = subprocess.run(
        [sys.executable, "-m", "pipetune", "bench", str(path), "--strategies",
         "pipetune-cold,optuna-plain", "--no-oracle", "--out", str(out), "--tracking-uri", uri],
        cwd=tmp_path, env={**os.environ, "PREFECT_API_URL": prefect_api_url},
        capture_output=True, text=True, timeout=600)
    captured = proc
    print(captured.stderr)  # the bench's own lines, for a failing run
    assert proc.returncode == 1
    said = [line for line in captured.stderr.splitlines() if line.startswith("[bench ")]
    failed = [line for line in said if "FAILED" in line]
    assert len(failed) == 2, said
    assert "pipetune-cold: FAILED" in failed[0] and "optuna-plain: FAILED" in failed[1]
    for line in failed:
        assert "RuntimeError: synthetic workload: planned failure at epoch 1" in line
    assert "2 of 2 strategies failed (pipetune-cold, optuna-plain)" in captured.stderr
    assert "Traceback" not in captured.stderr  # one line each, not Prefect's engine traceback
    assert f"report: {out}" in captured.stdout
    text = (out / "results.md").read_text()
    assert "| pipetune-cold (FAILED) |" in text and "| optuna-plain (FAILED) |" in text
    assert "- pipetune-cold FAILED: workload synthetic is broken: 3 trials failed with " \
        "RuntimeError" in text
    data = json.loads((out / "results.json").read_text())
    reasons = {s["strategy"]: s["failed"] for s in data["strategies"]}
    assert set(reasons) == {"pipetune-cold", "optuna-plain"}
    assert all("RuntimeError" in r for r in reasons.values()), reasons
    client = MlflowClient(uri)
    bench_run = client.get_run(data["bench_run_id"])
    assert bench_run.data.tags["pipetune.failed_strategies"] == "pipetune-cold,optuna-plain"
    kids = client.search_runs([bench_run.info.experiment_id],
                              f"tags.mlflow.parentRunId = '{bench_run.info.run_id}'")
    assert {k.data.tags["pipetune.strategy"]: k.info.status for k in kids} == {
        "pipetune-cold": "FAILED", "optuna-plain": "FAILED"}
    for kid in kids:
        assert kid.data.tags["pipetune.failure"] == reasons[kid.data.tags["pipetune.strategy"]]
    cold = next(k for k in kids if k.data.tags["pipetune.strategy"] == "pipetune-cold")
    study_run = client.get_run(cold.data.tags["pipetune.study_run_id"])  # linked both ways
    assert study_run.info.status == "FAILED"
    assert study_run.data.tags["pipetune.bench_run_id"] == bench_run.info.run_id
