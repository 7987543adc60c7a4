"""Deployments: the parameter schema Prefect enforces, the serve script, the job
stream's arithmetic, and, end to end, deployments/prefect.yaml on a real Prefect
server with a process worker, run as deployments/README.md says."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from pipetune import policies
from pipetune.spec.sections import IMPORT_PATH_PATTERN

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))

#: A valid inline job; tests break one field at a time.
INLINE_JOB = {
    "name": "inline",
    "workload": {"name": "synthetic", "params": {"train_samples": 64, "val_samples": 32}},
    "hyperparameters": {"lr": {"type": "loguniform", "low": 0.01, "high": 0.1}},
    "search": {"algorithm": "random", "trials": 2},
    "early_stopping": {"policy": "none", "max_epochs": 2},
}


@pytest.fixture(scope="module", autouse=True)
def prefect_settings_follow_the_environment():
    """Prefect reads its settings from the environment once, at import. This module
    imports it and changes PREFECT_HOME / PREFECT_API_URL for a while; afterwards,
    have Prefect read the (restored) environment again."""
    yield
    if "prefect.context" in sys.modules:
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()


def broken(path: str, value) -> dict:
    """INLINE_JOB with the dotted ``path`` set to ``value`` (None deletes it)."""
    job = copy.deepcopy(INLINE_JOB)
    *parents, last = path.split(".")
    node = job
    for key in parents:
        node = node[key]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return job


# -- the parameter schema the server enforces ------------------------------------------


@pytest.fixture(scope="module")
def schema():
    from prefect.utilities.callables import parameter_schema

    from flows.study import study_flow

    return parameter_schema(study_flow).model_dump_for_openapi()


def refusal(schema, parameters) -> str | None:
    """What the Prefect server would answer a run created with ``parameters``: None
    when it accepts them, else its message (the server calls this same function)."""
    from prefect.utilities.schema_tools.validation import ValidationError, validate

    try:
        validate(parameters, schema, raise_on_error=True)
    except ValidationError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    ("parameters", "field", "reason"),
    [
        ({"job": "examples/tiny_synthetic.yaml", "trials": 0}, "'trials'", "minimum of 1"),
        ({"job": "examples/tiny_synthetic.yaml", "core_budget": 0}, "'core_budget'", "minimum"),
        ({"job": "examples/tiny_synthetic.json"}, "'job'", "does not match"),
        ({"job": broken("workload.name", "resnet9000")}, "'job.workload.name'", "'resnet9000'"),
        ({"job": broken("workload.name", "no_colon.path")}, "'job.workload.name'", "match"),
        ({"job": broken("hyperparameters.lr.high", None)},
         "'job.hyperparameters.lr'", "'high' is a required property"),
        ({"job": broken("hyperparameters.lr.type", "gaussian")},
         "'job.hyperparameters.lr.type'", "'gaussian' is not one of"),
        ({"job": broken("hyperparameters.lr.step", 2)},
         "'job.hyperparameters.lr'", "'step' was unexpected"),
        ({"job": broken("hyperparameters.lr.low", -1.0)},
         "'job.hyperparameters.lr.low'", "minimum"),
        ({"job": broken("hyperparameters", {})}, "'job.hyperparameters'", "non-empty"),
        ({"job": broken("search.trials", 0)}, "'job.search.trials'", "minimum of 1"),
        ({"job": broken("search.algorithm", "bayes")}, "'job.search.algorithm'", "'bayes'"),
        ({"job": broken("early_stopping", None)}, "'job'", "'early_stopping' is a required"),
    ],
)
def test_the_server_refuses_bad_parameters_naming_them(schema, parameters, field, reason):
    message = refusal(schema, parameters)
    assert message is not None, parameters
    assert f"field {field}" in message and reason in message, message


def test_the_server_accepts_every_example_as_a_file_or_inline(schema):
    from pipetune.spec import load_spec

    assert refusal(schema, {"job": INLINE_JOB, "trials": 3, "pipetune": False}) is None
    for path in EXAMPLES:
        relative = str(path.relative_to(REPO))
        assert refusal(schema, {"job": relative}) is None
        as_written = json.loads(json.dumps(yaml.safe_load(path.read_text())))  # as sent
        assert refusal(schema, {"job": as_written}) is None, relative
        assert refusal(schema, {"job": load_spec(path).to_dict()}) is None, relative


def _resolve(schema: dict, node: dict) -> dict:
    ref = node.get("$ref")
    return _resolve(schema, schema["definitions"][ref.rsplit("/", 1)[1]]) if ref else node


def _job_models():
    """(dotted path, section model) for JobSpec and every section under it."""
    from pydantic import BaseModel

    from pipetune.spec import JobSpec

    todo, seen = [("", JobSpec)], []
    while todo:
        path, model = todo.pop(0)
        seen.append((path, model))
        for name, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                todo.append((f"{path}.{name}".lstrip("."), field.annotation))
    return seen


#: JSON-schema ``type`` of each Python type a job section field holds.
JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", dict: "object"}


def test_the_job_parameter_schema_is_the_job_spec_field_for_field(schema):
    """Every field of every section: in the deployment's schema, with the model's JSON
    type, default, bounds and required-ness; nothing else is allowed."""
    import typing

    (job_schema,) = [b for b in schema["properties"]["job"]["anyOf"] if b.get("type") != "string"]
    models = _job_models()
    assert {p for p, _ in models} >= {"workload", "search", "early_stopping", "pipetune.similarity"}
    for path, model in models:
        node = job_schema
        for part in filter(None, path.split(".")):
            node = _resolve(schema, node["properties"][part])
        node = _resolve(schema, node)
        assert node["additionalProperties"] is False, path
        assert set(node["properties"]) == set(model.model_fields), path
        assert set(node.get("required", [])) == {
            n for n, f in model.model_fields.items() if f.is_required()}, path
        for name, field in model.model_fields.items():
            where, prop = f"{path}.{name}", node["properties"][name]
            if field.default_factory is None and not field.is_required():
                assert prop["default"] == field.default, where
            # An optional field's bounds sit in the anyOf branch that is not null.
            value_schema = next(
                (b for b in prop.get("anyOf", [prop]) if b.get("type") != "null"), prop)
            for bound, key in (("ge", "minimum"), ("gt", "exclusiveMinimum"), ("le", "maximum")):
                for m in field.metadata:
                    if hasattr(m, bound):
                        assert value_schema[key] == getattr(m, bound), where
            annotation = field.annotation
            if (path, name) in POLICY_FIELDS:  # a built-in name, or an import path
                names, pattern = prop["anyOf"]
                assert names["enum"] == list(POLICY_FIELDS[path, name]()), where
                assert pattern == {"type": "string", "pattern": IMPORT_PATH_PATTERN}, where
            elif typing.get_origin(annotation) is typing.Literal:
                assert prop["enum" if "enum" in prop else "const"] in (
                    list(typing.get_args(annotation)), typing.get_args(annotation)[0]), where
            elif annotation in JSON_TYPES:
                assert prop["type"] == JSON_TYPES[annotation], where


#: Fields whose value is a policy's name (pipetune.policies): the schema lists the
#: built-in names and takes any import path.
POLICY_FIELDS = {("search", "algorithm"): policies.searcher_names,
                 ("early_stopping", "policy"): policies.scheduler_names}


def test_the_system_and_space_schemas_come_from_the_knobs_and_distributions(schema):
    from pipetune.space import Choice, IntUniform, LogUniform, Uniform
    from pipetune.system.config import KNOBS, SystemConfig

    (job_schema,) = [b for b in schema["properties"]["job"]["anyOf"] if b.get("type") != "string"]
    system = _resolve(schema, job_schema["properties"]["system"])
    default = _resolve(schema, system["properties"]["default"])
    space = _resolve(schema, system["properties"]["space"])
    assert list(default["properties"]) == list(KNOBS) == list(space["properties"])
    for knob, value in SystemConfig().to_dict().items():
        assert default["properties"][knob]["default"] == value, knob
    tags = job_schema["properties"]["hyperparameters"]["additionalProperties"]
    assert tags["properties"]["type"]["enum"] == [
        d.type_name for d in (Choice, Uniform, LogUniform, IntUniform)]
    # What the schema lets through, the spec's own knob rule agrees with, and back.
    for knob, bad in (("cores", 0), ("dataloader_workers", -1), ("device", "tpu")):
        assert refusal(schema, {"job": {**INLINE_JOB, "system": {"default": {knob: bad}}}}), knob
        assert refusal(schema, {"job": {**INLINE_JOB, "system": {"space": {knob: [bad]}}}}), knob
    assert refusal(schema, {"job": {**INLINE_JOB, "system": {"space": {"cores": [1, 2]}}}}) is None


def test_the_flow_gets_an_inline_job_as_the_plain_dict_it_was_given():
    from prefect.exceptions import ParameterTypeError

    from flows.study import study_flow

    checked = study_flow.validate_parameters({"job": INLINE_JOB, "trials": 2})
    assert checked["job"] == INLINE_JOB and type(checked["job"]) is dict
    assert study_flow.validate_parameters({"job": "a/b.yml"})["job"] == "a/b.yml"
    with pytest.raises(ParameterTypeError, match="trials"):
        study_flow.validate_parameters({"job": INLINE_JOB, "trials": 0})


# -- serve and the stream, without a server ----------------------------------------------


def test_serve_builds_the_deployments_prefect_yaml_declares(monkeypatch):
    from deployments.serve import build_deployments, load_declarations

    monkeypatch.chdir(REPO)  # serve_deployments runs from here too
    declared = load_declarations()
    built = {d.name: d for d in build_deployments(declared)}
    assert list(built) == [d["name"] for d in declared]
    assert {"tiny-synthetic", "lenet-digits-nightly", "on-demand"} <= set(built)
    for d in built.values():
        assert d.flow_name == "pipetune-study"
        assert d.entrypoint == "flows/study.py:study_flow"
        assert d.enforce_parameter_schema
        assert d._parameter_openapi_schema.properties["trials"]["anyOf"][0]["minimum"] == 1
    assert built["tiny-synthetic"].parameters == {"job": "examples/tiny_synthetic.yaml"}
    (nightly,) = built["lenet-digits-nightly"].schedules
    assert nightly.schedule.cron == "0 2 * * *" and nightly.active is False
    for job in (d.parameters.get("job") for d in built.values()):
        assert job is None or (REPO / job).is_file()


def test_poisson_arrivals_are_seeded_and_come_at_the_given_rate():
    from flows.stream import poisson_arrivals

    files = ["a.yaml", "b.yaml", "c.yaml"]
    arrivals = poisson_arrivals(4.0, 3000, seed=5, job_files=files)
    assert arrivals == poisson_arrivals(4.0, 3000, seed=5, job_files=files)
    assert arrivals != poisson_arrivals(4.0, 3000, seed=6, job_files=files)
    times = [a.at_s for a in arrivals]
    assert times == sorted(times) and times[0] > 0
    assert [a.index for a in arrivals] == list(range(3000))
    assert 0.9 * 15.0 < times[-1] / len(times) < 1.1 * 15.0  # mean gap 60 / 4 s
    assert {a.job for a in arrivals} == set(files)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(0.0, 3, seed=0, job_files=files)


def test_response_time_is_queue_wait_plus_tuning():
    from prefect.client.schemas.objects import FlowRun, State, StateType

    from flows.stream import Arrival, job_timing, summarize

    t0 = datetime(2026, 1, 1, tzinfo=UTC)

    def run(wait, tuning, state=StateType.COMPLETED):
        started = t0 + timedelta(seconds=wait) if wait is not None else None
        return FlowRun(
            id=uuid.uuid4(), name="r", flow_id=uuid.uuid4(), expected_start_time=t0,
            start_time=started,
            end_time=started + timedelta(seconds=tuning) if started else t0,
            state=State(type=state, name=state.value.title()),
        )

    timings = [
        job_timing(Arrival(0, 1.0, "a.yaml"), run(2.0, 30.0), pipetune=True),
        job_timing(Arrival(1, 5.0, "b.yaml"), run(28.0, 20.0), pipetune=True),
        job_timing(Arrival(2, 9.0, "a.yaml"), run(None, 0.0, StateType.CRASHED),
                   pipetune=True),
    ]
    assert [(t.queue_wait_s, t.tuning_s, t.response_s) for t in timings[:2]] == [
        (2.0, 30.0, 32.0), (28.0, 20.0, 48.0)]
    assert timings[2].state == "Crashed" and timings[2].queue_wait_s is None
    summary = summarize(timings)
    assert summary["jobs"] == 3 and summary["completed"] == 2
    assert summary["mean_queue_wait_s"] == 15.0 and summary["mean_tuning_s"] == 25.0
    assert summary["mean_response_s"] == 40.0 == 15.0 + 25.0


def test_serve_and_stream_refuse_bad_options(capsys):
    from pipetune.cli import main

    assert main(["stream", "--rate", "0"]) == 2
    assert "--rate" in capsys.readouterr().err
    assert main(["stream", "--jobs", "0"]) == 2
    assert "--jobs" in capsys.readouterr().err
    assert main(["stream", "--job", str(REPO / "examples" / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    assert main(["serve", "no-such-deployment"]) == 2
    assert "tiny-synthetic" in capsys.readouterr().err  # lists the known ones


# -- end to end: server, work pool, prefect deploy, a worker ----------------------------


def stop_tree(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """Stop ``proc``'s process group, then any of its descendants left (flow-run
    processes start their own sessions), each by process id."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
    alive = [p for p in descendants if p.is_running()]
    for p in alive:
        p.terminate()
    _, alive = psutil.wait_procs(alive, timeout=10)
    for p in alive:
        p.kill()


@contextmanager
def prefect_client(api_url: str):
    """A client of ``api_url`` whatever this process's Prefect settings were at import."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        with get_client(sync_client=True) as client:
            yield client


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """deployments/README.md's steps: a Prefect server on a free loopback port (own
    PREFECT_HOME), the work pool, ``prefect deploy --all``, a worker. The worker runs
    in a scratch folder (the deployments' pull step takes runs to the repository
    root) with PIPETUNE_HOME and MLFLOW_TRACKING_URI set, as a user would."""
    from pipetune.prefect_server import LocalPrefectServer, prefect_executable

    root = tmp_path_factory.mktemp("deployments")
    with ExitStack() as stack, pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFECT_HOME", str(root / "prefect"))
        mp.delenv("PREFECT_API_URL", raising=False)
        server = LocalPrefectServer(log_path=root / "server.log")
        stack.callback(server.stop)
        server.start()
        env = {
            **os.environ,
            "PREFECT_API_URL": server.api_url,
            "PIPETUNE_HOME": str(root / "home"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_LOGGING_LEVEL": "INFO",
        }

        def prefect(*args: str, check: bool = True) -> subprocess.CompletedProcess:
            done = subprocess.run(
                [prefect_executable(), *args], cwd=REPO, env=env, capture_output=True,
                text=True, timeout=180, stdin=subprocess.DEVNULL,
            )
            if check:
                output = done.stdout + done.stderr
                assert done.returncode == 0, f"prefect {' '.join(args)}:\n{output}"
            return done

        prefect("work-pool", "create", "pipetune", "--type", "process")
        prefect("work-pool", "set-concurrency-limit", "pipetune", "1")
        prefect("deploy", "--all", "--prefect-file", "deployments/prefect.yaml", "--no-prompt")
        (root / "worker").mkdir()
        worker_log = root / "worker.log"
        with open(worker_log, "wb") as out:
            worker = subprocess.Popen(
                [prefect_executable(), "worker", "start", "--pool", "pipetune"],
                cwd=root / "worker", env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        stack.callback(stop_tree, worker)
        yield {
            "api_url": server.api_url, "prefect": prefect, "worker_log": worker_log,
            "tracking_uri": env["MLFLOW_TRACKING_URI"],
        }


def run_and_wait(deployed, name: str, *options: str, limit_s: float = 400.0):
    """``prefect deployment run NAME`` as the README does, then the finished flow run."""
    done = deployed["prefect"]("deployment", "run", name, *options)
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", done.stdout).group(1)
    deadline = time.monotonic() + limit_s  # a guard against a hung run, not a measurement
    with prefect_client(deployed["api_url"]) as client:
        while True:
            flow_run = client.read_flow_run(flow_run_id)
            if flow_run.state is not None and flow_run.state.is_final():
                return flow_run
            if time.monotonic() > deadline:
                log = deployed["worker_log"].read_text(errors="replace")[-4000:]
                pytest.fail(f"flow run {flow_run_id} still {flow_run.state_name}; worker:\n{log}")
            time.sleep(1.0)


def parent_runs(tracking_uri: str) -> dict:
    """MLflow parent (study) runs by the Prefect flow-run id they carry."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("pipetune")
    if experiment is None:
        return {}
    runs = client.search_runs([experiment.experiment_id],
                              filter_string="tags.`pipetune.kind` = 'study'")
    return {r.data.tags["prefect.flow_run_id"]: r for r in runs}


@pytest.fixture(scope="module")
def two_runs(deployed):
    first = run_and_wait(deployed, "pipetune-study/tiny-synthetic")
    second = run_and_wait(deployed, "pipetune-study/tiny-synthetic")
    return first, second


@pytest.mark.slow
def test_a_recurring_job_reuses_the_ground_truth(deployed, two_runs):
    first, second = two_runs
    assert first.state.is_completed() and second.state.is_completed()
    with prefect_client(deployed["api_url"]) as client:
        deployment = client.read_deployment_by_name("pipetune-study/tiny-synthetic")
    assert first.deployment_id == second.deployment_id == deployment.id

    parents = parent_runs(deployed["tracking_uri"])
    one, two = parents[str(first.id)], parents[str(second.id)]
    for run in (one, two):
        assert run.info.status == "FINISHED"
        assert run.data.tags["prefect.deployment_id"] == str(deployment.id)
        assert run.data.tags["prefect.deployment_name"] == "tiny-synthetic"
    assert one.data.metrics["study_probe_epochs"] > 0  # nothing known yet: trial 0 probed
    assert two.data.metrics["study_probe_epochs"] < one.data.metrics["study_probe_epochs"]
    assert two.data.metrics["study_groundtruth_hits"] > 0


@pytest.mark.slow
def test_the_flow_run_links_its_mlflow_run_and_its_tasks_reach_the_server(deployed, two_runs):
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
    )

    first, _ = two_runs
    parent = parent_runs(deployed["tracking_uri"])[str(first.id)]
    with prefect_client(deployed["api_url"]) as client:
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[first.id]))
        )
        assert artifact.key == "mlflow-run" and parent.info.run_id in artifact.data
        names: list[str] = []
        deadline = time.monotonic() + 30  # task-run records arrive as events
        while time.monotonic() < deadline and not any(n.startswith("trial-0-epoch-1")
                                                      for n in names):
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[first.id])))
            names = [r.name for r in runs]
            time.sleep(0.5)
    # Epoch tasks ran on the flow run's Dask workers: they reported to this server.
    assert any(n.startswith("trial-0-epoch-1") for n in names), names


@pytest.mark.slow
def test_bad_parameters_are_refused_when_the_run_is_created(deployed, two_runs):
    from prefect.exceptions import PrefectHTTPStatusError

    mlflow_before = set(parent_runs(deployed["tracking_uri"]))
    with prefect_client(deployed["api_url"]) as client:
        runs_before = {r.id for r in client.read_flow_runs()}

    done = deployed["prefect"]("deployment", "run", "pipetune-study/tiny-synthetic",
                               "-p", "trials=0", check=False)
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode != 0
    assert "Validation failed for field 'trials'" in out and "minimum of 1" in out, out

    with prefect_client(deployed["api_url"]) as client:
        on_demand = client.read_deployment_by_name("pipetune-study/on-demand")
        for job, field in ((broken("workload.name", "resnet9000"), "job.workload.name"),
                           (broken("hyperparameters.lr.high", None), "job.hyperparameters.lr")):
            with pytest.raises(PrefectHTTPStatusError) as refused:
                client.create_flow_run_from_deployment(on_demand.id, parameters={"job": job})
            assert refused.value.response.status_code == 409
            assert f"field '{field}'" in refused.value.response.json()["detail"]
        assert {r.id for r in client.read_flow_runs()} == runs_before
    assert set(parent_runs(deployed["tracking_uri"])) == mlflow_before


@pytest.mark.slow
def test_a_deployment_run_naming_a_path_outside_the_allowed_roots_is_refused(
        deployed, two_runs, tmp_path):
    """The worker allows its PIPETUNE_HOME and working folder; a run asking to write
    checkpoints elsewhere fails naming the parameter, and records nothing."""
    mlflow_before = set(parent_runs(deployed["tracking_uri"]))
    outside = tmp_path / "elsewhere"
    run = run_and_wait(deployed, "pipetune-study/tiny-synthetic",
                       "-p", f"checkpoint_root={outside}")
    assert run.state.is_failed()
    assert "checkpoint_root" in run.state.message and "outside the allowed roots" in \
        run.state.message, run.state.message
    assert set(parent_runs(deployed["tracking_uri"])) == mlflow_before
    assert not outside.exists()


@pytest.mark.slow
def test_the_nightly_schedule_is_declared_paused(deployed):
    with prefect_client(deployed["api_url"]) as client:
        nightly = client.read_deployment_by_name("pipetune-study/lenet-digits-nightly")
    (schedule,) = nightly.schedules
    assert schedule.schedule.cron == "0 2 * * *" and schedule.active is False
    assert nightly.enforce_parameter_schema and nightly.work_pool_name == "pipetune"


def test_a_job_checked_by_the_caller_reaches_the_flow_as_it_is():
    """``pipetune tune`` checks its job once and hands the flow the spec itself: the
    flow takes it as it is; deployments are not offered that form."""
    from flows.study import resolve_job, study_flow
    from pipetune.spec import load_spec

    spec = load_spec(REPO / "examples" / "tiny_synthetic.yaml")
    assert study_flow.validate_parameters({"job": spec})["job"] is spec
    assert resolve_job(spec, None, None) is spec
    assert resolve_job(spec, spec.search.trials + 1, None).search.trials == spec.search.trials + 1


@pytest.mark.slow
def test_a_deployment_run_of_a_broken_workload_fails_with_one_line(deployed):
    """Every trial raises in its first epoch: the run ends Failed in Prefect, with the
    study's one-line reason as its state message, and the MLflow study run FAILED."""
    job = broken("workload.params.fail_at_epoch", 1)
    job["search"] = {**job["search"], "trials": 12}
    with prefect_client(deployed["api_url"]) as client:
        on_demand = client.read_deployment_by_name("pipetune-study/on-demand")
        created = client.create_flow_run_from_deployment(on_demand.id, parameters={"job": job})
    deadline = time.monotonic() + 400  # a guard against a hung run, not a measurement
    with prefect_client(deployed["api_url"]) as client:
        while not ((run := client.read_flow_run(created.id)).state
                   and run.state.is_final()) and time.monotonic() < deadline:
            time.sleep(1.0)
    assert run.state.is_failed(), run.state
    message = run.state.message
    assert "\n" not in message.strip(), message
    assert "is broken" in message and "RuntimeError: synthetic workload: planned failure" \
        in message, message
    parent = parent_runs(deployed["tracking_uri"])[str(created.id)]
    assert parent.info.status == "FAILED"
    assert "planned failure" in parent.data.tags["pipetune.failure"]
