"""``pipetune.tune()``, the Python API: a script a user writes (a workload class of its
own, defined in ``__main__``), run as a real process on the embedded default; its
errors as exceptions; the pieces it is made of (a class sent by value, the notebook's
progress bar) on real studies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from known import synthetic_job

import pipetune
from pipetune.errors import SpecError, WorkloadError

SCRIPT = '''
import json, sys
import pipetune
from pipetune.workloads import SyntheticWorkload


class Doubled(SyntheticWorkload):
    """Defined here, in __main__: no import path reaches it, so it goes by value."""

    metrics = ("doubled", *SyntheticWorkload.metrics)

    def evaluate(self, system):
        metrics = super().evaluate(system)
        metrics["doubled"] = 2 * metrics["accuracy"]
        return metrics


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    result = pipetune.tune(job, workload=Doubled, trials=2, progress=False)
    trials, epochs = result.trials_dataframe(), result.epochs_dataframe()
    best = result.load_best_workload()
    model = result.load_best_model()
    print(json.dumps({
        "repr": repr(result),
        "best_trial": result.best_trial, "best_value": result.best_value,
        "best_params": result.best_params, "best_system": result.best_system.label(),
        "trials": trials.to_dict("records"), "epochs": epochs.to_dict("records"),
        "run_id": result.run_id, "runs": result.trial_run_ids(),
        "flow_run_id": result.flow_run_id, "links": result.links,
        "model": type(model).__name__,
        "reloaded": best.evaluate(pipetune.SystemConfig(cores=1))["doubled"],
    }, default=str))
'''


@pytest.mark.slow
def test_a_script_tunes_its_own_class_and_reads_the_study_back(tmp_path):
    job = synthetic_job("api-script", trials=3)
    job["objective"]["metric"] = "doubled"  # only the script's own class reports it
    (tmp_path / "tune_it.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PIPETUNE_HOME"] = str(tmp_path / "home")
    proc = subprocess.run([sys.executable, "tune_it.py", json.dumps(job)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    trials, epochs = out["trials"], out["epochs"]
    assert [t["trial"] for t in trials] == [0, 1]  # trials=2 overrode the job's 3
    assert all(t["state"] == "completed" and t["epochs"] == 3 for t in trials)
    for t in trials:
        (last,) = [e for e in epochs if e["trial"] == t["trial"] and e["epoch"] == 3]
        assert t["value"] == last["metrics.doubled"]
        assert set(t) >= {"params.lr", "system", "system.interop_threads", "duration_s"}
    assert len(epochs) == 6 and {e["phase"] for e in epochs} >= {"profile", "train"}
    assert all(e["metrics.doubled"] == 2 * e["metrics.accuracy"] for e in epochs)
    # The system tuner's answer for this job is known: interop_threads=2.
    assert "interop=2" in out["best_system"]
    best = trials[out["best_trial"]]
    assert out["best_params"] == {"lr": best["params.lr"]}
    assert out["best_value"] == best["value"] and f"trial {out['best_trial']}" in out["repr"]
    # The best model, rebuilt here from its checkpoint, scores what its last epoch did.
    assert out["model"] == "Sequential"
    assert out["reloaded"] == pytest.approx(out["best_value"])

    # MLflow has the study: its parent run names the class as sent, a run per trial.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = client.get_run(out["run_id"])
    assert parent.data.params["workload"].startswith("pipetune.workloads.shipped:Doubled_")
    runs = {int(k): v for k, v in out["runs"].items()}
    assert sorted(runs) == [0, 1] and len(set(runs.values())) == 2
    assert [t["run_id"] for t in trials] == [runs[0], runs[1]]
    for trial_id, run_id in runs.items():
        run = client.get_run(run_id)
        assert run.data.tags["mlflow.parentRunId"] == out["run_id"]
        assert run.data.tags["pipetune.trial_id"] == str(trial_id)
    assert out["flow_run_id"]  # the study's Prefect flow run was created
    assert out["links"]["mlflow_run"].endswith(
        f"/runs/{out['run_id']}?workflowType=machine_learning")


UNGUARDED = '''
import pipetune
from pipetune.workloads import SyntheticWorkload


class Mine(SyntheticWorkload):
    pass


pipetune.tune({job!r}, workload=Mine, progress=False)
'''


@pytest.mark.slow
def test_a_script_without_the_main_guard_is_told_what_to_write(tmp_path):
    (tmp_path / "unguarded.py").write_text(UNGUARDED.format(job=synthetic_job("unguarded")))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PIPETUNE_HOME"] = str(tmp_path / "home")
    proc = subprocess.run([sys.executable, "unguarded.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert 'under `if __name__ == "__main__":`' in last, proc.stderr[-3000:]


# -- errors, before anything starts ------------------------------------------------------

def test_errors_are_the_commands_one_line_errors_as_exceptions(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = synthetic_job("api-errors")
    with pytest.raises(SpecError) as bad:
        pipetune.tune({**job, "search": {**job["search"], "algorithm": "annealing"}})
    assert bad.value.field == "search.algorithm"
    with pytest.raises(SpecError) as zero:
        pipetune.tune(job, trials=0)
    assert zero.value.field == "trials" and "must be an integer >= 1" in str(zero.value)
    with pytest.raises(SpecError) as keep:
        pipetune.tune(job, keep_checkpoints="some")
    assert keep.value.field == "keep_checkpoints"
    with pytest.raises(WorkloadError, match="must be a pipetune.workloads.Workload subclass"):
        pipetune.tune(job, workload=object)
    with pytest.raises(SpecError) as kind:
        pipetune.tune(42)
    assert kind.value.field == "job"
    with pytest.raises(SpecError) as missing:
        pipetune.tune(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(missing.value)
    assert not (tmp_path / "mlflow.db").exists()  # nothing recorded


# -- a class sent by value -----------------------------------------------------------------

def test_an_importable_class_goes_by_its_path_and_a_local_one_by_value():
    from pipetune.workloads import SyntheticWorkload, resolve_workload, shipped, torch_workload

    assert shipped.workload_name(SyntheticWorkload) == \
        "pipetune.workloads.synthetic:SyntheticWorkload"

    class Local(SyntheticWorkload):
        pass

    name = shipped.workload_name(Local)
    assert name.startswith("pipetune.workloads.shipped:Local_")
    assert resolve_workload(name) is Local
    assert shipped.workload_name(Local) == name  # the same class, the same name

    import torch

    def splits(params):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        y = (x[:, 0] > 0).long()
        return (x[:48], y[:48]), (x[48:], y[48:])

    made = torch_workload(model=lambda hp: torch.nn.Linear(4, 2), data=splits,
                          hparams={"lr": 0.1, "batch_size": 16})
    fname = shipped.workload_name(made)
    data = shipped.blob(fname)
    assert data is not None
    # A worker: nothing shipped yet, then the plugin's install.
    shipped._classes.pop(fname.removeprefix(shipped.PREFIX))
    with pytest.raises(WorkloadError):
        resolve_workload(fname)
    shipped.install(fname, data)
    rebuilt = resolve_workload(fname)
    assert rebuilt is not made and rebuilt.name == fname
    w = rebuilt()
    w.setup({"lr": 0.1, "batch_size": 16}, seed=0)
    w.train_epoch(pipetune.SystemConfig(cores=1))
    assert 0.0 <= w.evaluate(pipetune.SystemConfig(cores=1))["accuracy"] <= 1.0


def test_a_class_that_cannot_be_pickled_is_refused_by_name():
    import threading

    from pipetune.workloads import SyntheticWorkload
    from pipetune.workloads.shipped import workload_name

    class Locked(SyntheticWorkload):
        guard = threading.Lock()

    with pytest.raises(WorkloadError, match="'.*Locked' cannot be sent to the workers"):
        workload_name(Locked)


# -- the notebook's progress bar -------------------------------------------------------------

def test_the_notebook_bar_counts_every_ended_trial(tmp_path):
    from pipetune.api.progress import TrialsBar, display_for
    from pipetune.checkpoints import CheckpointStore
    from pipetune.engine.study import Study, run_study_locally
    from pipetune.spec import JobSpec
    from pipetune.system.config import MachineInfo

    assert display_for(False)(3, "accuracy").__class__.__name__ == "NoDisplay"
    job = synthetic_job("bar", trials=3)
    job["workload"]["params"]["cost_by_knob"] = {}
    machine = MachineInfo(cores=1)
    spec = JobSpec.from_dict(job, machine=machine)
    study = Study(spec, study_id="bar", checkpoints=CheckpointStore(tmp_path / "ck"),
                  core_budget=1, machine=machine)
    with TrialsBar(3, "accuracy") as bar:
        study.observe(bar.observe)
        run_study_locally(study)
        assert bar._bar.n == 3 and bar._bar.total == 3
        assert bar._bar.postfix and "accuracy=" in bar._bar.postfix


def test_importing_pipetune_does_not_import_the_api():
    code = textwrap.dedent("""
        import sys, pipetune
        assert "pipetune.api" not in sys.modules
        assert callable(pipetune.tune) and "pipetune.api" in sys.modules
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr
