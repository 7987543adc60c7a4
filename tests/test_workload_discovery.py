"""Your own workload module, found without PYTHONPATH: by the ``pipetune`` console
script run from the module's folder or from anywhere else (the job file's folder), by
every worker of an embedded cluster started before the job was read, and shipped to
a ``dask scheduler`` + ``dask worker`` started elsewhere. Its own errors read as one
line. Real processes throughout, no mocks."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from known import synthetic_job

BIN = Path(sys.executable).parent
PIPETUNE = BIN / "pipetune"  # the console script: no working folder on its sys.path

MODULE = '''
from pipetune.errors import WorkloadParamError
from pipetune.workloads.synthetic import SyntheticWorkload


class MyWorkload(SyntheticWorkload):
    """The synthetic workload under the user's own name."""


class Widths(SyntheticWorkload):
    def __init__(self, width=1, **params):
        if width <= 0:
            raise WorkloadParamError("width", "must be > 0")
        super().__init__(**params)


class Picky(SyntheticWorkload):
    def __init__(self, **params):
        raise ValueError("colour must be red")


class Broken(SyntheticWorkload):
    def __init__(self, **params):
        raise RuntimeError("the data server\\nis down")
'''


def job(workload: str, **params) -> dict:
    data = synthetic_job("discovery", trials=2)
    data["workload"] = {"name": workload,
                        "params": {"train_samples": 64, "val_samples": 32, **params}}
    data["early_stopping"]["max_epochs"] = 2
    data["pipetune"] = {"enabled": False}
    return data


def user_folder(root: Path, module: str = "mymod", workload: str = "MyWorkload",
                **params) -> Path:
    """``root/code``: ``<module>.py`` and ``job.yaml`` naming ``<module>:<workload>``."""
    code = root / "code"
    code.mkdir(parents=True, exist_ok=True)
    (code / f"{module}.py").write_text(MODULE)
    path = code / "job.yaml"
    path.write_text(yaml.safe_dump(job(f"{module}:{workload}", **params)))
    return path


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env


def validate(job_path: Path | str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(PIPETUNE), "validate", str(job_path)], cwd=cwd,
                          env=clean_env(), capture_output=True, text=True, timeout=120)


@pytest.fixture
def own_path(monkeypatch):
    """This process's sys.path, PYTHONPATH and added folders, restored afterwards."""
    import pipetune.modules

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(pipetune.modules, "_added", {})
    monkeypatch.delenv("PYTHONPATH", raising=False)
    yield
    os.environ.pop("PYTHONPATH", None)


def unique(name: str) -> str:
    """A module name not imported before in this process."""
    return f"{name}_{os.getpid()}_{time.monotonic_ns()}"


# -- (a) the console script finds the module -------------------------------------------


def test_validate_from_the_module_folder_and_from_elsewhere(tmp_path):
    path = user_folder(tmp_path)
    here = validate("job.yaml", cwd=path.parent)
    assert here.returncode == 0, here.stderr
    assert "name: mymod:MyWorkload" in here.stdout
    (tmp_path / "elsewhere").mkdir()
    there = validate(path, cwd=tmp_path / "elsewhere")
    assert there.returncode == 0, there.stderr


def test_a_module_in_the_working_folder_serves_a_job_file_elsewhere(tmp_path):
    path = user_folder(tmp_path)
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "job.yaml").write_text(path.read_text())
    assert validate(jobs / "job.yaml", cwd=path.parent).returncode == 0


def test_a_missing_module_says_where_it_was_looked_for(tmp_path):
    path = user_folder(tmp_path)
    (path.parent / "mymod.py").unlink()
    result = validate(path, cwd=tmp_path)
    assert result.returncode == 2
    assert "No module named 'mymod'" in result.stderr
    assert f"the job file's folder and the working folder ({path.parent.resolve()}" in (
        result.stderr)


# -- (c) a workload's own errors ----------------------------------------------------------


def test_a_workload_param_error_names_the_param(tmp_path):
    path = user_folder(tmp_path, workload="Widths", width=0)
    result = validate(path, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"error: {path}: workload.params.width: must be > 0"]
    assert result.stdout == ""


@pytest.mark.parametrize(("workload", "words"), [
    ("Broken", "RuntimeError: the data server is down"),
    ("Picky", "ValueError: colour must be red"),
])
def test_any_other_constructor_error_is_one_line_naming_the_workload(tmp_path, workload, words):
    path = user_folder(tmp_path, workload=workload)
    result = validate(path, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: {path}: workload: mymod:{workload} failed to build from workload.params: "
        f"{words}"]
    assert "Traceback" not in result.stderr and "hyperparameters" not in result.stderr


def test_the_spec_error_in_process(tmp_path, own_path):
    from pipetune.errors import SpecError
    from pipetune.spec import load_spec

    name = unique("widths")
    path = user_folder(tmp_path, module=name, workload="Widths", width=-1)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert (info.value.field, info.value.message) == ("workload.params.width", "must be > 0")
    assert str(info.value) == "workload.params.width: must be > 0"
    assert str(path.parent.resolve()) in os.environ["PYTHONPATH"].split(os.pathsep)


def test_a_built_in_workload_changes_no_path(tmp_path, own_path):
    from pipetune.modules import added_folders
    from pipetune.spec import load_spec

    before = list(sys.path)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job("synthetic")))
    load_spec(path)
    assert sys.path == before and added_folders() == () and "PYTHONPATH" not in os.environ


def test_a_deployment_run_appends_the_job_folder_only(tmp_path, own_path):
    from pipetune.confine import Confinement, enforced
    from pipetune.modules import added_folders
    from pipetune.spec import load_spec

    name = unique("confined_mod")
    path = user_folder(tmp_path, module=name)
    with enforced(Confinement(roots=("/",), modules=(name,))):
        load_spec(path)
    folder = str(path.parent.resolve())
    assert sys.path[-1] == folder and added_folders(appended=True) == (folder,)
    assert "PYTHONPATH" not in os.environ  # nothing this worker starts later inherits it


# -- (b) the embedded cluster's workers ---------------------------------------------------


def test_a_study_on_the_embedded_cluster_started_before_the_job_was_read(tmp_path, own_path):
    from pipetune.backends import DaskBackend
    from pipetune.checkpoints import CheckpointStore
    from pipetune.dask.cluster import (
        client_for,
        close_shared_cluster,
        prepare_workload,
        shared_cluster,
    )
    from pipetune.dask.ship import check_workload
    from pipetune.engine.study import Study
    from pipetune.spec import load_spec
    from pipetune.states import TrialState

    close_shared_cluster()
    try:
        shared_cluster(workers=2)  # as `serve`/`bench` hold it: started once, reused
        client = client_for(None)
        name = unique("embedded_mod")
        spec = load_spec(user_folder(tmp_path, module=name))
        workload = f"{name}:MyWorkload"
        before = client.run(check_workload, workload)
        assert len(before) == 2 and all("No module named" in v for v in before.values())

        prepare_workload(client, spec, None)
        assert set(client.run(check_workload, workload).values()) == {None}
        study = Study(spec, study_id="embedded", core_budget=2,
                      checkpoints=CheckpointStore(str(tmp_path / "ck")))
        study.run(DaskBackend(client))
        assert [t.state for t in study.trials.values()] == [TrialState.COMPLETE] * 2
        assert study.summary().epochs_run == 4

        # a worker that starts later (restarted, a new group) gets the folders too
        client.restart(wait_for_workers=True)
        assert set(client.run(check_workload, workload).values()) == {None}
    finally:
        close_shared_cluster()


# -- (d) a separate scheduler and worker: the module is shipped --------------------------


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """A ``dask scheduler`` and a ``dask worker`` whose working folder and HOME hold no
    user code, with no PYTHONPATH."""
    from distributed import Client

    from pipetune.net import free_port

    home = tmp_path_factory.mktemp("worker-home")
    address = f"tcp://127.0.0.1:{free_port()}"
    env = clean_env(HOME=str(home), DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES="0")
    procs = [subprocess.Popen(
        [str(BIN / "dask"), *args], cwd=home, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=(home / f"{args[0]}.log").open("w"))
        for args in (["scheduler", "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1],
                      "--no-dashboard"],
                     ["worker", address, "--nworkers", "1", "--nthreads", "1",
                      "--resources", "cores=2", "--no-dashboard", "--local-directory",
                      str(home / "scratch")])]
    client = None
    try:
        for _ in range(120):
            with contextlib.suppress(OSError):
                client = Client(address, timeout=2, set_as_default=False)
                break
            time.sleep(0.5)
        assert client is not None, (home / "scheduler.log").read_text()[-2000:]
        client.wait_for_workers(1, timeout=120)
        yield address, client
    finally:
        if client is not None:
            client.close()
        for proc in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def one_epoch(client, workload: str, tmp_path: Path, params: dict):
    from pipetune.backends import DaskBackend
    from pipetune.runner import EpochTask
    from pipetune.spec import ProfilerSpec
    from pipetune.states import Phase
    from pipetune.system.config import SystemConfig

    task = EpochTask(
        study_id="shipped", trial_id=0, epoch=1, phase=Phase.PROFILE, system=SystemConfig(),
        workload=workload, workload_params=params, hparams={"lr": 0.05}, seed=0,
        checkpoint_in=None, checkpoint_out=str(tmp_path / "ck" / "epoch-1.pt"),
        profiler=ProfilerSpec(op_mix_steps=1))
    return DaskBackend(client).run(task)


def test_a_single_module_is_shipped_to_a_separate_worker(remote, tmp_path, own_path):
    from pipetune.dask.cluster import prepare_workload
    from pipetune.dask.ship import check_workload
    from pipetune.spec import load_spec

    address, client = remote
    name = unique("shipped_mod")
    spec = load_spec(user_folder(tmp_path, module=name))
    workload = f"{name}:MyWorkload"
    (before,) = client.run(check_workload, workload).values()
    assert f"No module named '{name}'" in before  # not importable there by itself

    assert prepare_workload(client, spec, address).startswith("shipped ")
    result = one_epoch(client, workload, tmp_path, spec.workload.params)
    assert result.epoch == 1 and 0.0 <= result.metrics["accuracy"] <= 1.0
    (where,) = client.run(lambda: sys.modules[name].__file__).values()
    assert Path(where).parent != tmp_path / "code"  # the shipped copy, in its scratch space

    # an edited module is shipped again and replaces the old copy
    (tmp_path / "code" / f"{name}.py").write_text(MODULE + "\nEDITED = True\n")
    prepare_workload(client, spec, address)
    (edited,) = client.run(lambda: getattr(sys.modules[name], "EDITED", False)).values()
    assert edited is True


def test_a_package_is_shipped_whole(remote, tmp_path, own_path):
    from pipetune.dask.cluster import prepare_workload
    from pipetune.spec import load_spec

    address, client = remote
    package = unique("shipped_pkg")
    code = tmp_path / "code" / package
    (code / "nets").mkdir(parents=True)
    (code / "__init__.py").write_text("")
    (code / "nets" / "__init__.py").write_text("")
    (code / "helpers.py").write_text("WIDTH = 24\n")
    (code / "nets" / "mlp.py").write_text(textwrap.dedent(f"""
        from {package}.helpers import WIDTH
        from pipetune.workloads.synthetic import SyntheticWorkload

        class Net(SyntheticWorkload):
            def __init__(self, **params):
                super().__init__(**{{"features": WIDTH, **params}})
    """))
    path = tmp_path / "code" / "job.yaml"
    path.write_text(yaml.safe_dump(job(f"{package}.nets.mlp:Net")))
    spec = load_spec(path)
    assert prepare_workload(client, spec, address) == f"shipped {code.resolve()} to the workers"
    result = one_epoch(client, f"{package}.nets.mlp:Net", tmp_path, spec.workload.params)
    assert result.metrics["accuracy"] >= 0.0


def test_a_module_that_needs_what_is_not_shipped_is_a_clear_error(remote, tmp_path, own_path):
    from pipetune.dask.cluster import prepare_workload
    from pipetune.dask.ship import check_workload
    from pipetune.errors import WorkloadError
    from pipetune.spec import load_spec

    address, client = remote
    name, helper = unique("needy_mod"), unique("helper")
    path = user_folder(tmp_path, module=name)
    (path.parent / f"{helper}.py").write_text("X = 1\n")
    (path.parent / f"{name}.py").write_text(f"import {helper}\n" + MODULE)
    spec = load_spec(path)
    with pytest.raises(WorkloadError) as info:
        prepare_workload(client, spec, address)
    message = str(info.value)
    assert f"No module named '{helper}'" in message and address in message
    assert f"shipped {path.parent.resolve() / (name + '.py')} alone" in message
    assert "__init__.py" in message and "pip install" in message
    assert "\n" not in message
    # nothing stale is left registered: later workers do not try it
    names = client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.worker_plugins))
    assert not [n for n in names if name in n]
    (answer,) = client.run(check_workload, f"{name}:MyWorkload").values()
    assert answer is not None


# -- the whole command, for real ----------------------------------------------------------


@pytest.mark.slow
def test_pipetune_tune_from_elsewhere_without_pythonpath(tmp_path):
    path = user_folder(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = clean_env(PIPETUNE_HOME=str(elsewhere / "home"))
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.run([str(PIPETUNE), "tune", str(path), "--trials", "1"], cwd=elsewhere,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MLflow: run" in proc.stdout
    studies = list((elsewhere / "home" / "studies").iterdir())
    events = (studies[0] / "events.jsonl").read_text().splitlines()
    assert sum(json.loads(e).get("kind") == "result" for e in events) >= 1, events[:5]


def test_a_validator_error_about_the_whole_job_does_not_dump_it():
    from pipetune.spec import JobSpec
    from pipetune.spec.messages import describe

    error = {"type": "value_error", "loc": (), "msg": "Value error, boom\n  here",
             "input": {"name": "x", "workload": {}}, "ctx": {"error": ValueError("boom\n  here")}}
    assert describe(error, JobSpec) == "boom here"
    field = {**error, "loc": ("workload", "params"), "input": {"a": 1}}
    assert describe(field, JobSpec) == "boom here, got {'a': 1}"


def test_module_origin_tells_shipped_code_from_installed(tmp_path, own_path):
    from pipetune.modules import make_importable, module_origin

    assert module_origin("yaml").installed and module_origin("yaml").distribution == "PyYAML"
    assert module_origin("json.decoder").installed
    package = unique("origin_pkg")
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "solo.py").write_text("")
    make_importable([str(tmp_path)])
    pkg, solo = module_origin(f"{package}.nets"), module_origin("solo")
    assert (pkg.top, pkg.root, pkg.is_package, pkg.installed) == (
        package, str(tmp_path.resolve()), True, False)
    assert (solo.path, solo.is_package, solo.installed) == (
        str((tmp_path / "solo.py").resolve()), False, False)
    assert module_origin(unique("nowhere")).root is None


def test_your_own_tasks_flows_and_deployments_modules_do_not_stand_in_for_pipetunes(tmp_path):
    """Modules named like pipetune's own top-level packages, beside the job and in the
    working folder (first on every process's path), are not what pipetune imports:
    the study records its Prefect task runs in full; a workload in such a module is
    refused by name."""
    path = user_folder(tmp_path)
    for name in ("tasks", "flows", "deployments"):
        (path.parent / f"{name}.py").write_text(
            f"raise RuntimeError('the user\\'s own {name}.py was imported')\n")
    env = clean_env(PIPETUNE_HOME=str(tmp_path / "home"))
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.run([sys.executable, "-m", "pipetune", "tune", "job.yaml", "--trials",
                           "1"], cwd=path.parent, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "was imported" not in proc.stderr + proc.stdout
    assert "failed" not in proc.stderr and "incomplete" not in proc.stderr, proc.stderr[-3000:]
    assert "flow ended" in proc.stdout  # the study flow's run ended, its task runs in
    assert "task-run record is incomplete" not in proc.stderr + proc.stdout

    (path.parent / "tasks.py").write_text(MODULE)
    path.write_text(yaml.safe_dump(job("tasks:MyWorkload")))
    refused = validate(path, cwd=path.parent)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "'tasks' is one of pipetune's own packages" in refused.stderr, refused.stderr
