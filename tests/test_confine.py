"""Deployment runs are confined to the roots and workload modules the worker allows
(pipetune/confine.py), and the study flow checks its parameters with that policy
before anything is recorded."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from pipetune.confine import (
    MODULES_ENV,
    ROOTS_ENV,
    Confinement,
    enforced,
    split_modules,
    split_roots,
)
from pipetune.errors import ConfinementError, SpecError
from pipetune.spec import JobSpec
from tests.known import synthetic_job


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "allowed"
    (folder / "jobs").mkdir(parents=True)
    return folder


@pytest.fixture
def policy(root: Path, tmp_path: Path) -> Confinement:
    return Confinement(roots=(str(root), "s3://team-bucket/pipetune"), cwd=str(root))


def refused(call, *args, **kwargs) -> ConfinementError:
    with pytest.raises(ConfinementError) as caught:
        call(*args, **kwargs)
    return caught.value


# -- paths ------------------------------------------------------------------------------


def test_a_path_under_a_root_passes_resolved(policy, root):
    assert policy.check_path("checkpoint_root", str(root / "ckpt")) == str(root / "ckpt")
    assert policy.check_path("job", "jobs/a.yaml") == str(root / "jobs" / "a.yaml")  # cwd
    assert policy.check_path("job", str(root)) == str(root)


def test_a_path_outside_every_root_is_refused_naming_the_field(policy, tmp_path):
    error = refused(policy.check_path, "checkpoint_root", str(tmp_path / "elsewhere"))
    assert isinstance(error, SpecError) and error.field == "checkpoint_root"
    assert str(error).startswith(f"checkpoint_root: {tmp_path / 'elsewhere'} is outside "
                                 "the allowed roots (")
    assert f"set {ROOTS_ENV} on the worker to allow it" in str(error)
    refused(policy.check_path, "groundtruth_path", "/etc/passwd")


def test_a_sibling_sharing_the_root_prefix_is_outside(policy, root):
    refused(policy.check_path, "job", str(root) + "-evil/job.yaml")


def test_dot_dot_cannot_escape(policy, root):
    assert policy.check_path("job", str(root / "jobs" / ".." / "b.yaml")) == str(root / "b.yaml")
    error = refused(policy.check_path, "job", "jobs/../../outside.yaml")
    assert "outside.yaml" in error.message and str(root.parent / "outside.yaml") in error.message


def test_a_symlink_inside_a_root_pointing_outside_is_refused(policy, root, tmp_path):
    outside = tmp_path / "secret"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    refused(policy.check_path, "checkpoint_root", str(root / "link"))
    refused(policy.check_path, "job", str(root / "link" / "job.yaml"))
    (tmp_path / "in").symlink_to(root / "jobs")  # outside pointing in: what is opened is in
    assert policy.check_path("job", str(tmp_path / "in" / "a.yaml")) == str(
        root / "jobs" / "a.yaml")


def test_home_is_expanded_only_where_the_opener_expands_it(root, monkeypatch):
    monkeypatch.setenv("HOME", str(root))
    policy = Confinement(roots=(str(root / "jobs"),), cwd=str(root / "jobs"))
    assert policy.check_path("groundtruth_path", "~/jobs/gt.json") == str(root / "jobs/gt.json")
    # a job file is opened as given: "~/x" is a folder named ~ in the working folder
    assert policy.check_path("job", "~/x.yaml", expanduser=False) == str(
        root / "jobs" / "~" / "x.yaml")


def test_a_file_url_is_a_local_path(policy, root):
    assert policy.check_path("checkpoint_root", (root / "c").as_uri()) == str(root / "c")
    refused(policy.check_path, "checkpoint_root", "file:///etc")
    refused(policy.check_path, "checkpoint_root", "file://otherhost/data")


def test_urls_pass_only_under_a_listed_url_root():
    policy = Confinement(roots=("/", "S3://team-bucket/pipetune/"))
    assert policy.check_path("checkpoint_root", "s3://team-bucket/pipetune") == (
        "s3://team-bucket/pipetune")
    assert policy.check_path("checkpoint_root", "s3://team-bucket/pipetune/ckpt/x")
    for url in ("s3://team-bucket/pipetune-other", "s3://team-bucket", "s3://evil/pipetune",
                "gs://team-bucket/pipetune/x", "memory://x", "simplecache::s3://evil/x"):
        refused(policy.check_path, "checkpoint_root", url)  # "/" allows no URL
    error = refused(policy.check_path, "checkpoint_root", "s3://team-bucket/pipetune/../x")
    assert "'..'" in error.message


def test_empty_and_odd_values_are_refused(policy):
    for value in ("", "   ", None, 3):
        assert refused(policy.check_path, "job", value).field == "job"
    refused(policy.check_path, "job", "jobs/a\x00.yaml")


def test_tracking_uris(policy, root):
    policy.check_tracking_uri("tracking_uri", f"sqlite:///{root / 'mlflow.db'}")
    policy.check_tracking_uri("tracking_uri", "sqlite:///mlflow.db")  # relative to cwd
    policy.check_tracking_uri("tracking_uri", "sqlite://")  # in memory
    policy.check_tracking_uri("tracking_uri", f"file:{root / 'mlruns'}")
    policy.check_tracking_uri("tracking_uri", (root / "mlruns").as_uri())
    policy.check_tracking_uri("tracking_uri", str(root / "mlruns"))
    for uri in ("sqlite:////tmp/elsewhere.db", "sqlite:///../x.db", "file:///tmp/mlruns",
                "http://mlflow.example:5000", "postgresql://u@db/mlflow"):
        assert refused(policy.check_tracking_uri, "tracking_uri", uri).field == "tracking_uri"
    server = Confinement(roots=("https://mlflow.example:5000",))
    server.check_tracking_uri("tracking_uri", "https://mlflow.example:5000")
    refused(server.check_tracking_uri, "tracking_uri", "https://mlflow.example:50001")


# -- workload modules -------------------------------------------------------------------


def test_built_in_workloads_are_always_allowed():
    policy = Confinement(roots=("/",))
    for name in ("lenet5", "textcnn", "synthetic", "pipetune.workloads.synthetic:X",
                 " synthetic ", "no-colon-left-for-resolve"):
        policy.check_workload(name)


def test_import_path_workloads_need_their_module_listed():
    policy = Confinement(roots=("/",))
    error = refused(policy.check_workload, "tests.flaky_workload:FlakyWorkload")
    assert error.field == "workload.name"
    assert "imports module 'tests.flaky_workload'" in error.message
    assert f"set {MODULES_ENV} on the worker" in error.message
    refused(policy.check_workload, "pipetune.cli:main")  # only pipetune.workloads is built in
    refused(policy.check_workload, "os:system")

    listed = Confinement(roots=("/",), modules=("tests", "team.models."))
    listed.check_workload("tests.flaky_workload:FlakyWorkload")
    listed.check_workload("tests:Anything")
    listed.check_workload("team.models.cnn:CNN")
    for name in ("testsx.mod:W", "team:W", "team.modelsx:W"):
        refused(listed.check_workload, name)
    Confinement(roots=("/",), modules=("*",)).check_workload("anything.at.all:W")


# -- the environment ----------------------------------------------------------------------


def test_roots_split_on_pathsep_keeping_url_colons():
    raw = "/data: s3://b/p :https://h:5000/x::/home/me:http://h:8080"
    assert split_roots(raw, sep=":") == ["/data", "s3://b/p", "https://h:5000/x", "/home/me",
                                         "http://h:8080"]
    assert split_roots("C:\\data;s3://b", sep=";") == ["C:\\data", "s3://b"]
    assert split_roots("  ", sep=":") == []


def test_modules_split_on_commas_and_are_checked():
    assert split_modules("mylab, team.models., *,,") == ["mylab", "team.models", "*"]
    error = refused(split_modules, "mylab, bad-name")
    assert error.field == MODULES_ENV and "'bad-name'" in error.message


def test_the_default_roots_are_the_pipetune_home_and_the_working_folder(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    policy = Confinement.from_env({"PIPETUNE_HOME": str(home)}, cwd=cwd)
    assert policy.roots == (str(home), str(cwd)) and policy.modules == ()
    policy.check_path("groundtruth_path", str(home / "groundtruth.json"))
    policy.check_path("job", "examples/x.yaml")
    refused(policy.check_path, "job", str(tmp_path / "x.yaml"))
    bare = Confinement.from_env({}, cwd=cwd)
    assert bare.roots[0] == os.path.realpath(Path.home() / ".pipetune")


def test_the_environment_replaces_the_default_roots(tmp_path):
    env = {ROOTS_ENV: f"{tmp_path / 'data'}{os.pathsep}s3://b/p", MODULES_ENV: "mylab",
           "PIPETUNE_HOME": str(tmp_path / "home")}
    policy = Confinement.from_env(env, cwd=tmp_path / "cwd")
    assert policy.roots == (str(tmp_path / "data"), "s3://b/p")
    assert policy.modules == ("mylab",)
    refused(policy.check_path, "job", "x.yaml")  # the working folder is no longer a root
    policy.check_workload("mylab.nets:Net")


def test_a_run_may_not_set_the_policy_through_its_job_variables(policy):
    policy.check_job_variables(None)
    policy.check_job_variables({"env": {"OMP_NUM_THREADS": "1"}, "stream_output": True})
    for key in (ROOTS_ENV, MODULES_ENV, "PIPETUNE_HOME", "MLFLOW_TRACKING_URI"):
        error = refused(policy.check_job_variables, {"env": {key: "/"}})
        assert error.field == f"job_variables.env.{key}"
    assert refused(policy.check_job_variables,
                   {"working_dir": "/"}).field == "job_variables.working_dir"


def test_the_policy_pickles():
    import pickle

    policy = Confinement(roots=("/srv", "s3://b"), modules=("mylab",), cwd="/srv")
    assert pickle.loads(pickle.dumps(policy)) == policy
    error = ConfinementError("job", "outside")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is ConfinementError and again.field == "job"


# -- enforced: a job's workload is refused before its module is imported -------------------


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """Two user modules on sys.path: one that leaves a mark when imported, one with a
    real workload."""
    folder = tmp_path / "user_code"
    folder.mkdir()
    mark = tmp_path / "imported.mark"
    (folder / "confine_canary.py").write_text(
        f"from pathlib import Path\nPath({str(mark)!r}).write_text('ran')\n")
    (folder / "confine_allowed.py").write_text(textwrap.dedent("""
        from pipetune.workloads.synthetic import SyntheticWorkload

        class Allowed(SyntheticWorkload):
            pass
    """))
    monkeypatch.syspath_prepend(str(folder))
    yield mark
    for name in ("confine_canary", "confine_allowed"):
        sys.modules.pop(name, None)


def job_with(workload: str) -> dict:
    job = synthetic_job("confine")
    job["workload"]["name"] = workload
    return job


def test_enforced_refuses_a_module_before_importing_it(user_modules):
    policy = Confinement(roots=("/",))
    with enforced(policy), pytest.raises(ConfinementError) as caught:
        JobSpec.from_dict(job_with("confine_canary:Workload"))
    assert caught.value.field == "workload.name"
    assert not user_modules.exists() and "confine_canary" not in sys.modules
    # outside the block nothing is enforced (the local CLI): the module runs
    with pytest.raises(SpecError):
        JobSpec.from_dict(job_with("confine_canary:Workload"))
    assert user_modules.read_text() == "ran"


def test_enforced_lets_an_allowed_module_through(user_modules):
    with enforced(Confinement(roots=("/",), modules=("confine_allowed",))):
        spec = JobSpec.from_dict(job_with("confine_allowed:Allowed"))
    assert spec.workload.name == "confine_allowed:Allowed"
    with enforced(None):  # None enforces nothing
        JobSpec.from_dict(job_with("confine_allowed:Allowed"))


# -- the study flow's entry: what a deployment run goes through ---------------------------


def study_params(**overrides):
    return {"job": None, "tracking_uri": None, "checkpoint_root": None,
            "groundtruth_path": None, **overrides}


def test_a_run_not_from_a_deployment_is_not_confined(tmp_path):
    from pipetune.confine import confine_parameters

    params = study_params(job="/anywhere/job.yaml", checkpoint_root="/anywhere/ckpt",
                          tracking_uri="sqlite:////anywhere/mlflow.db")
    assert confine_parameters(params, from_deployment=False) == (params, None)


def test_a_deployment_run_gets_its_paths_checked_and_resolved(policy, root, tmp_path):
    from pipetune.confine import confine_parameters

    params = study_params(job="jobs/../jobs/a.yaml", checkpoint_root=str(root / "ckpt"),
                          groundtruth_path="gt.json",
                          tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    checked, used = confine_parameters(params, from_deployment=True, policy=policy)
    assert used is policy
    assert checked == {**params, "job": str(root / "jobs" / "a.yaml"),
                       "checkpoint_root": str(root / "ckpt"),
                       "groundtruth_path": str(root / "gt.json")}

    outside = str(tmp_path / "outside")
    for name, value in (("job", f"{outside}/a.yaml"), ("checkpoint_root", outside),
                        ("groundtruth_path", f"{outside}/gt.json"),
                        ("tracking_uri", f"sqlite:///{outside}/mlflow.db")):
        error = refused(confine_parameters, study_params(**{name: value}),
                        from_deployment=True, policy=policy)
        assert error.field == name and str(error).startswith(f"{name}: ")
    error = refused(confine_parameters, study_params(job=job_with("os:system")),
                    from_deployment=True, policy=policy)
    assert error.field == "job.workload.name"
    error = refused(confine_parameters, study_params(job="jobs/a.yaml"),
                    from_deployment=True, policy=policy,
                    job_variables={"env": {ROOTS_ENV: "/"}})
    assert error.field == f"job_variables.env.{ROOTS_ENV}"


def test_the_workers_default_tracking_uri_and_policy_come_from_its_environment(
        tmp_path, monkeypatch):
    from pipetune.confine import confine_parameters

    monkeypatch.setenv(ROOTS_ENV, str(tmp_path / "data"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://team-mlflow:5000")
    checked, policy = confine_parameters(
        study_params(job={"name": "inline"}, tracking_uri="http://team-mlflow:5000"),
        from_deployment=True)
    assert policy.roots == (str(tmp_path / "data"),)
    refused(confine_parameters, study_params(tracking_uri="http://other:5000"),
            from_deployment=True)


def test_a_resumed_study_is_confined_like_a_new_one(policy, root, tmp_path):
    from pipetune.confine import confine_resumed

    header = {"job": synthetic_job("x"), "tracking_uri": f"sqlite:///{root / 'm.db'}",
              "checkpoint_root": "ckpt", "groundtruth_path": None}
    assert confine_resumed(header, None) is header
    assert confine_resumed(header, policy) is header  # checked, kept as recorded
    error = refused(confine_resumed, {**header, "checkpoint_root": str(tmp_path / "o")}, policy)
    assert error.field == "checkpoint_root"
    assert error.message.startswith("resume: the study's ")


def test_a_deployed_stream_reads_only_allowed_job_files(policy, root, tmp_path):
    from flows.stream import confine_stream

    assert confine_stream(["/x.yaml"], None, from_deployment=False) == (["/x.yaml"], None)
    files, used = confine_stream(["jobs/a.yaml"], None, from_deployment=True, policy=policy)
    assert files == [str(root / "jobs" / "a.yaml")] and used is policy
    error = refused(confine_stream, ["jobs/a.yaml", str(tmp_path / "b.yaml")], None,
                    from_deployment=True, policy=policy)
    assert error.field == "job_files.1"


def test_store_urls_a_team_uses_are_confined_like_paths(tmp_path, monkeypatch):
    """A ground truth named by URL: a SQLite file is checked as the file it is, a
    server database against the allowed URL prefixes (its password never repeated);
    the worker's own defaults and ``checkpoint_root: mlflow`` are its own choice."""
    from pipetune.confine import confine_parameters
    from pipetune.errors import ConfinementError

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    monkeypatch.setenv("PIPETUNE_ALLOWED_ROOTS", str(allowed))
    monkeypatch.delenv("PIPETUNE_GROUNDTRUTH", raising=False)
    inside = f"sqlite:///{allowed}/gt.db"
    checked, _ = confine_parameters({"groundtruth_path": inside}, from_deployment=True)
    assert checked["groundtruth_path"] == inside
    with pytest.raises(ConfinementError) as e:
        confine_parameters({"groundtruth_path": f"sqlite:///{tmp_path}/gt.db"},
                           from_deployment=True)
    assert e.value.field == "groundtruth_path"
    secret = "postgresql://alice:s3cret@db.example.org/pipetune"
    with pytest.raises(ConfinementError) as e:
        confine_parameters({"groundtruth_path": secret}, from_deployment=True)
    assert "s3cret" not in str(e.value) and "alice:***@" in str(e.value)
    monkeypatch.setenv("PIPETUNE_GROUNDTRUTH", secret)  # the worker's own: not checked
    checked, _ = confine_parameters({"groundtruth_path": secret}, from_deployment=True)
    assert checked["groundtruth_path"] == secret
    checked, _ = confine_parameters({"checkpoint_root": "mlflow"}, from_deployment=True)
    assert checked["checkpoint_root"] == "mlflow"
