"""A system space wider than the machine: values no worker can run drop out of the
probes with one warning line, recorded in the study; only a knob with no value that
fits (or a default that does not fit) refuses the job, as one ``error:`` line with no
Prefect traceback before it (issue 23, item 5)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from known import process_cluster

from pipetune.errors import SystemConfigError
from pipetune.spec import JobSpec, SpaceDrop, SystemSpec, load_spec
from pipetune.system.config import MachineInfo, SystemConfig

ROOT = Path(__file__).resolve().parents[1]
PIPETUNE = [sys.executable, "-m", "pipetune"]
ONE_CORE = MachineInfo(cores=1)
TWO_CORES = MachineInfo(cores=2)
HERE = len(os.sched_getaffinity(0))  # this machine's cores, as validation counts them


# -- the library ------------------------------------------------------------------------


def test_values_needing_more_cores_are_dropped_with_one_note_per_knob():
    spec = SystemSpec(space={"cores": [1, 2, 4, 8], "dataloader_workers": [0, 1]})
    fitted, drops = spec.fit(TWO_CORES)
    assert fitted.space == {"cores": [1, 2], "dataloader_workers": [0, 1]}
    assert drops == (SpaceDrop("cores", (4, 8), "this machine has 2 cores"),)
    assert drops[0].line() == "system.space.cores: 4, 8 dropped: this machine has 2 cores"
    assert drops[0].to_dict() == {"values": [4, 8], "reason": "this machine has 2 cores"}
    assert spec.space["cores"] == [1, 2, 4, 8]  # a value: fitting makes a new one


def test_the_note_says_where_the_core_count_comes_from():
    spec = SystemSpec(space={"cores": [1, 2]})
    note = "the cluster's largest worker advertises 1 core"
    fitted, drops = spec.fit(ONE_CORE, cores_note=note)
    assert fitted.space == {"cores": [1]}  # only the default's value: nothing to probe
    assert [d.line() for d in drops] == [f"system.space.cores: 2 dropped: {note}"]
    assert fitted.candidates() == {"cores": [SystemConfig(cores=1)]}


def test_a_space_that_fits_is_returned_as_it_is():
    spec = SystemSpec(space={"cores": [1, 2]})
    assert spec.fit(TWO_CORES) == (spec, ())
    assert spec.fit(TWO_CORES)[0] is spec


def test_a_knob_with_no_value_that_fits_is_refused_naming_it():
    with pytest.raises(SystemConfigError) as refused:
        SystemSpec(space={"cores": [2, 4]}).fit(ONE_CORE)
    assert refused.value.field == "system.space.cores"
    assert refused.value.message == "no value fits: 2, 4 (this machine has 1 core)"


def test_a_default_that_does_not_fit_is_still_refused():
    with pytest.raises(SystemConfigError) as refused:
        SystemSpec(default=SystemConfig(cores=2), space={"cores": [1, 2]}).fit(
            ONE_CORE, cores_note="the cluster's largest worker advertises 1 core")
    assert refused.value.field == "system.default.cores"
    assert refused.value.message == (
        "2 cores requested but the cluster's largest worker advertises 1 core")


@pytest.mark.parametrize("space, field, words", [
    ({"device": ["cuda"]}, "system.space.device", "no CUDA device"),
    ({"precision": ["bf16"]}, "system.space.precision", "needs native bf16"),
])
def test_other_machine_misfits_are_still_refused_not_dropped(space, field, words):
    """Only core counts drop out: a knob the machine cannot honour at all is refused."""
    with pytest.raises(SystemConfigError) as refused:
        SystemSpec(space={"cores": [1, 4], **space}).fit(TWO_CORES)
    assert refused.value.field == field
    assert words in refused.value.message


def test_validation_keeps_the_space_and_a_job_fits_on_the_machine_it_runs_on():
    data = load_spec(ROOT / "examples/lenet_digits.yaml", machine=TWO_CORES).to_dict()
    data["system"]["space"]["cores"] = [1, 2, 4]
    spec = JobSpec.from_dict(data, machine=TWO_CORES)  # not refused: 1 and 2 fit
    assert spec.system.space["cores"] == [1, 2, 4]
    fitted, drops = spec.fit(ONE_CORE)
    assert fitted.system.space["cores"] == [1]
    assert fitted.system.space["dataloader_workers"] == [0, 1]
    assert [d.knob for d in drops] == ["cores"] and drops[0].values == (2, 4)
    assert fitted.search == spec.search and fitted.name == spec.name
    data["system"]["space"]["cores"] = [4, 8]
    with pytest.raises(SystemConfigError, match="no value fits: 4, 8"):
        JobSpec.from_dict(data, machine=TWO_CORES)


# -- the command line -------------------------------------------------------------------


def run(args, cwd: Path, env_extra=None, timeout=600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PIPETUNE_HOME"] = str(cwd / "home")
    env.update(env_extra or {})
    return subprocess.run(PIPETUNE + args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def example_job(tmp_path: Path, cores: list[int], name: str = "job.yaml") -> Path:
    """``examples/lenet_digits.yaml`` as it is, but for ``system.space.cores``."""
    data = yaml.safe_load((ROOT / "examples/lenet_digits.yaml").read_text())
    data["system"]["space"]["cores"] = cores
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_validate_warns_of_a_value_this_machine_cannot_run_and_exits_0(tmp_path):
    job = example_job(tmp_path, [1, HERE + 1])
    proc = run(["validate", str(job)], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"warning: {job}: system.space.cores: {HERE + 1} dropped: this machine has "
        f"{HERE} core{'s' if HERE != 1 else ''}"]
    assert yaml.safe_load(proc.stdout)["system"]["space"]["cores"] == [1, HERE + 1]


def test_validate_refuses_a_knob_none_of_whose_values_fits(tmp_path):
    job = example_job(tmp_path, [HERE + 1, HERE + 2])
    proc = run(["validate", str(job)], tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"error: {job}: system.space.cores: no value fits: {HERE + 1}, {HERE + 2} "
        f"(this machine has {HERE} core{'s' if HERE != 1 else ''})"]


@pytest.fixture(scope="module")
def one_core_workers():
    """Two process workers advertising 1 core each: ``pipetune stack up``'s default."""
    with process_cluster(n_workers=2, cores=1) as cluster:
        yield cluster.scheduler_address


@pytest.mark.slow
def test_the_example_runs_on_one_core_workers_without_its_cores_2_probe(
        tmp_path, one_core_workers, prefect_api_url):
    job = example_job(tmp_path, [1, 2])
    proc = run(["tune", str(job), "--trials", "2", "--dask-address", one_core_workers],
               tmp_path, env_extra={"PREFECT_API_URL": prefect_api_url})
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output
    about_cores = [line for line in proc.stderr.splitlines() if "system.space.cores" in line]
    assert about_cores == [
        "warning: system.space.cores: 2 dropped: the cluster's largest worker advertises "
        "1 core"]
    # No epoch ran under cores=2.
    assert "cores=2" not in proc.stdout

    dropped = {"cores": {"values": [2],
                         "reason": "the cluster's largest worker advertises 1 core"}}
    (header_path,) = glob.glob(str(tmp_path / "home" / "studies" / "*" / "study.json"))
    header = json.loads(Path(header_path).read_text())
    assert header["space_dropped"] == dropped
    assert header["job"]["system"]["space"]["cores"] == [1]

    import mlflow

    run_id = next(line.split()[2] for line in proc.stdout.splitlines()
                  if line.startswith("MLflow: run "))
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    tags = client.get_run(run_id).data.tags
    assert json.loads(tags["pipetune.space_dropped"]) == dropped


@pytest.mark.slow
def test_a_job_no_worker_can_run_is_refused_in_one_line(
        tmp_path, one_core_workers, prefect_api_url):
    """Refused inside the flow (validation on this machine passes: it has the cores),
    and still exactly one line: no flow-engine traceback before it."""
    if HERE < 2:
        pytest.skip("needs a machine with 2 cores, so validation here lets the job pass")
    job = example_job(tmp_path, [2])
    proc = run(["tune", str(job), "--trials", "2", "--dask-address", one_core_workers],
               tmp_path, env_extra={"PREFECT_API_URL": prefect_api_url})
    assert proc.returncode == 2, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output and "Encountered exception" not in output
    errors = [line for line in output.splitlines() if "system.space.cores" in line]
    assert errors == [
        "error: system.space.cores: no value fits: 2 (the cluster's largest worker "
        "advertises 1 core)"]
    assert proc.stderr.splitlines()[-1] == errors[0]
    assert not glob.glob(str(tmp_path / "home" / "studies" / "*"))  # nothing recorded
