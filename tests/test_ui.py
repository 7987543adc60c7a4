"""`pipetune ui` and the links into the MLflow UI: pure link functions, then the UI as a
user runs it (a real subprocess) on the store of a real tiny study."""

from __future__ import annotations

import doctest
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml
from known import synthetic_job

from pipetune.tracking import links
from pipetune.tracking.links import (
    experiment_runs_url,
    run_url,
    study_filter,
    study_runs_url,
    ui_base_url,
)

PIPETUNE = [sys.executable, "-m", "pipetune"]
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _env(folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env["PIPETUNE_HOME"] = str(folder / "home")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fragment_query(url: str) -> tuple[str, dict[str, str]]:
    """The route and query of an MLflow UI link (a hash route: both after ``#``)."""
    route, _, query = urllib.parse.urlsplit(url).fragment.partition("?")
    return route, dict(urllib.parse.parse_qsl(query))


# -- links, no server ------------------------------------------------------------------


def test_the_link_functions_doctests_pass():
    result = doctest.testmod(links)
    assert result.attempted >= 8 and result.failed == 0


def test_a_tracking_servers_address_is_its_ui_without_credentials():
    base = ui_base_url("https://bob:pa%40ss@mlflow.example.org/team/?token=x#frag")
    assert base == "https://mlflow.example.org/team"
    assert "bob" not in base and "pa" not in base and "token" not in base
    assert ui_base_url("sqlite:////tmp/x/mlflow.db", port=5123) == "http://127.0.0.1:5123"


def test_a_study_link_opens_the_model_training_runs_table_filtered_to_the_study():
    url = study_runs_url("http://127.0.0.1:5000", "4", "abc-123")
    assert url.startswith("http://127.0.0.1:5000/#/")
    route, query = _fragment_query(url)
    assert route == "/experiments/4/runs"
    assert query == {"workflowType": "machine_learning",
                     "searchFilter": "tags.`pipetune.study_id` = 'abc-123'"}
    assert _fragment_query(experiment_runs_url("http://h:1", "4"))[1] == {
        "workflowType": "machine_learning"}
    assert _fragment_query(run_url("http://h:1", "r1", "4"))[0] == "/experiments/4/runs/r1"
    assert _fragment_query(run_url("http://h:1", "r1"))[0] == "/runs/r1"


def test_a_study_id_with_a_quote_cannot_break_out_of_the_filter():
    with pytest.raises(ValueError, match="quotes"):
        study_filter("x' or 1=1 or '")


# -- a real study, then `pipetune ui` on its store --------------------------------------


@pytest.fixture(scope="module")
def study_store(tmp_path_factory):
    """A folder with ``mlflow.db`` from a real 2-trial `pipetune tune`, and its output."""
    folder = tmp_path_factory.mktemp("ui-store")
    job = folder / "job.yaml"
    job.write_text(yaml.safe_dump(synthetic_job("ui-tiny", trials=2)))
    proc = subprocess.run([*PIPETUNE, "tune", str(job)], cwd=folder, env=_env(folder),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder, proc.stdout


def test_the_end_of_tune_links_exactly_the_studys_runs(study_store):
    folder, out = study_store
    from mlflow.tracking import MlflowClient

    run_id = next(line.split()[2] for line in out.splitlines() if line.startswith("MLflow: run "))
    (line,) = [line for line in out.splitlines() if line.strip().startswith("open http")]
    assert "pipetune ui" in line  # how to open it, on the same line
    url = line.split()[1]
    route, query = _fragment_query(url)
    assert url.startswith("http://127.0.0.1:5000/#/")
    assert query["workflowType"] == "machine_learning"

    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    parent = client.get_run(run_id)
    assert route == f"/experiments/{parent.info.experiment_id}/runs"
    found = client.search_runs([parent.info.experiment_id], query["searchFilter"])
    trials = [r for r in found if r.data.tags.get("mlflow.parentRunId") == run_id]
    assert {r.info.run_id for r in found} == {run_id} | {r.info.run_id for r in trials}
    assert len(trials) == 2


class _Ui:
    """`pipetune ui` running in the background, its stdout read line by line."""

    def __init__(self, folder: Path, *args: str):
        self.port = _free_port()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [*PIPETUNE, "ui", "--port", str(self.port), *args], cwd=folder, env=_env(folder),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no line matching {pattern!r}; output:\n" + "\n".join(self.lines))

    def tree(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def close(self) -> None:
        if self.proc.poll() is None:
            for p in self.tree()[::-1]:
                p.kill()
        self.proc.wait(30)


def _get(url: str) -> tuple[int, bytes]:
    with NO_PROXY.open(url, timeout=10) as answer:
        return answer.status, answer.read()


def test_ui_is_one_worker_on_loopback_ready_when_it_says_and_ctrl_c_stops_it(study_store):
    folder, _ = study_store
    ui = _Ui(folder, "--study", "latest")
    try:
        ui.wait_for(r"MLflow UI ready on http://127\.0\.0\.1:\d+")
        # Right after "ready": the server answers, the UI page and the API alike.
        base = f"http://127.0.0.1:{ui.port}"
        assert _get(f"{base}/health")[0] == 200
        status, page = _get(f"{base}/")
        assert status == 200 and b"<html" in page.lower()
        # The page opens on Model training where the browser has not chosen (a trial
        # clicked in the runs table, whose link has no workflowType, included).
        assert page.count(b'localStorage.setItem("mlflow.workflowType_v1"') == 1
        assert page.index(b"workflowType_v1") < page.index(b"<script defer")
        link = ui.wait_for(r"study (\S+) \(run (\S+)\): (http\S+)", timeout=10)
        study_id, run_id, url = link.groups()
        assert url.startswith(f"{base}/#/")
        assert _get(url)[0] == 200  # what the browser fetches: the fragment stays in it
        route, query = _fragment_query(url)
        assert query["searchFilter"] == study_filter(study_id)
        assert query["workflowType"] == "machine_learning"
        found = _search(base, route.split("/")[2], query["searchFilter"])
        assert run_id in found and len(found) == 3  # the study's run and its 2 trials

        # The Prefect UI too, over the same home: the study's finished flow run.
        prefect = ui.wait_for(r"Prefect UI \(started here\), the studies' flow runs: "
                              r"(http://127\.0\.0\.1:(\d+))/runs", timeout=60)
        flow_run = ui.wait_for(r"its flow run: (http\S+)/runs/flow-run/(\S+)", timeout=10)
        assert flow_run.group(1) == prefect.group(1)
        status, body = _get(f"{prefect.group(1)}/api/flow_runs/{flow_run.group(2)}")
        assert status == 200 and json.loads(body)["state_type"] == "COMPLETED"
        assert json.loads(body)["name"] == study_id
        page = urllib.request.Request(f"{flow_run.group(1)}/runs/flow-run/{flow_run.group(2)}",
                                      headers={"Accept": "text/html"})  # as a browser asks
        with NO_PROXY.open(page, timeout=10) as answer:
            assert answer.status == 200 and b"<html" in answer.read().lower()  # the UI's page

        tree = ui.tree()
        argvs = [p.cmdline() for p in tree]
        commands = [" ".join(a) for a in argvs]
        assert not any("huey" in c or "mlflow.server.jobs" in c for c in commands), commands
        servers = [a for a in argvs if a[1:3] in (["-m", "uvicorn"], ["-m", "gunicorn"])]
        assert len(servers) == 1, commands  # one web server process ...
        assert "--workers 1" in " ".join(servers[0]), servers  # ... no workers of its own
        mlflow = [c for c in commands if "mlflow" in c]
        assert len(mlflow) == 2, commands  # the mlflow command, the web server
        assert any("prefect" in c and "server" in c for c in commands), commands
        listening = {(c.laddr.ip, c.laddr.port) for p in tree
                     for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        assert listening == {("127.0.0.1", ui.port), ("127.0.0.1", int(prefect.group(2)))}, \
            listening

        ui.proc.send_signal(signal.SIGINT)
        assert ui.proc.wait(30) == 0
        _, alive = psutil.wait_procs(tree[1:], timeout=10)
        assert alive == [], alive
    finally:
        ui.close()


def _search(base: str, experiment_id: str, filter_string: str) -> set[str]:
    body = json.dumps({"experiment_ids": [experiment_id], "filter": filter_string}).encode()
    request = urllib.request.Request(f"{base}/api/2.0/mlflow/runs/search", data=body,
                                     headers={"Content-Type": "application/json"})
    with NO_PROXY.open(request, timeout=10) as answer:
        return {r["info"]["run_id"] for r in json.loads(answer.read()).get("runs", [])}


def test_ui_links_a_trials_study_and_by_default_the_whole_runs_table(study_store):
    folder, out = study_store
    from mlflow.tracking import MlflowClient

    run_id = next(line.split()[2] for line in out.splitlines() if line.startswith("MLflow: run "))
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    parent = client.get_run(run_id)
    trial = client.search_runs([parent.info.experiment_id],
                               f"tags.`mlflow.parentRunId` = '{run_id}'")[0]
    ui = _Ui(folder)
    try:
        ui.wait_for("ready")
        default = ui.wait_for(r"runs of experiment pipetune: (http\S+)", timeout=10).group(1)
        assert _fragment_query(default) == (f"/experiments/{parent.info.experiment_id}/runs",
                                            {"workflowType": "machine_learning"})
        from pipetune.cli.ui import _Rest, _target

        base = f"http://127.0.0.1:{ui.port}"
        for study in (trial.info.run_id, parent.data.tags["pipetune.study_id"], run_id):
            line, flow_run_id = _target(_Rest(base), base, "pipetune", study)
            assert f"(run {run_id})" in line, (study, line)
            assert urllib.parse.quote_plus(study_filter(parent.data.tags["pipetune.study_id"])) \
                in line
            assert flow_run_id == parent.data.tags["prefect.flow_run_id"]
        assert "no study 'nope'" in _target(_Rest(base), base, "pipetune", "nope")[0]
    finally:
        ui.close()


def test_ui_on_a_port_in_use_is_one_line(study_store):
    folder, _ = study_store
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([*PIPETUNE, "ui", "--port", str(port)], cwd=folder,
                              env=_env(folder), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"127.0.0.1:{port} is in use" in proc.stderr and "Traceback" not in proc.stderr


def test_ui_says_so_when_the_server_dies_before_it_answers(tmp_path):
    broken = tmp_path / "mlflow.db"
    broken.write_bytes(b"this is not a SQLite database" * 100)
    proc = subprocess.run([*PIPETUNE, "ui", "--port", str(_free_port())], cwd=tmp_path,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "exited" in proc.stderr and "before it answered" in proc.stderr
    assert "ready" not in proc.stdout


def _bench(run_id: str | None, study_run_id: str | None):
    from pipetune.bench import BenchResult, StrategyResult

    return BenchResult(
        job="tiny", metric="accuracy", mode="max", data="blobs", quick=True, machine="m",
        command="pipetune bench job.yaml", date="2026-12-05 21:00 UTC", bench_run_id=run_id,
        strategies=[StrategyResult.failure("pipetune-cold", "ValueError: x",
                                           study_run_id=study_run_id)])


def test_the_bench_report_links_the_bench_run(tmp_path):
    from pipetune.bench import markdown, write_report

    assert "http" not in markdown(_bench("b1", None))  # no UI named, no link
    text = markdown(_bench("b1", None), ui_base="https://mlflow.example.org")
    (line,) = [line for line in text.splitlines() if "MLflow bench run" in line]
    assert line.endswith("<https://mlflow.example.org/#/runs/b1?workflowType=machine_learning>")
    paths = write_report(_bench("b1", None), tmp_path / "out", ui_base="http://127.0.0.1:5000")
    assert "<http://127.0.0.1:5000/#/runs/b1?" in paths["markdown"].read_text()


def test_bench_prints_the_bench_run_and_each_study_run_as_links(study_store, capsys):
    from mlflow.tracking import MlflowClient

    from pipetune.cli.bench import _print_links

    folder, out = study_store
    run_id = next(line.split()[2] for line in out.splitlines() if line.startswith("MLflow: run "))
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    experiment_id = MlflowClient(uri).get_run(run_id).info.experiment_id
    _print_links(_bench("b1", run_id), uri)
    lines = capsys.readouterr().out.splitlines()
    # No pipetune-bench experiment in this store: MLflow's direct run route finds it.
    assert lines[0].startswith("  open http://127.0.0.1:5000/#/runs/b1?workflowType=")
    assert f"pipetune ui --tracking-uri {uri}" in lines[0]
    assert lines[1] == (f"  pipetune-cold study run: http://127.0.0.1:5000/#/experiments/"
                        f"{experiment_id}/runs/{run_id}?workflowType=machine_learning")


def test_the_model_training_hook_changes_the_page_and_nothing_else():
    from flask import Flask, Response

    from pipetune.tracking.ui_app import MODEL_TRAINING_FIRST, model_training_first

    app = Flask(__name__)
    with app.test_request_context("/"):
        page = model_training_first(Response("<html><head><title>x</title></head></html>",
                                             mimetype="text/html"))
        assert page.get_data(as_text=True) == \
            f"<html><head>{MODEL_TRAINING_FIRST}<title>x</title></head></html>"
        again = model_training_first(page)  # served twice, injected once
        assert again.get_data(as_text=True).count("workflowType_v1") == 2
        data = model_training_first(Response('{"runs": []}', mimetype="application/json"))
        assert data.get_data(as_text=True) == '{"runs": []}'
        missing = model_training_first(Response("<html><head></head></html>", status=404,
                                                mimetype="text/html"))
        assert b"localStorage" not in missing.get_data()


def test_the_runs_table_opens_on_the_objective_the_system_config_and_the_params(tmp_path):
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.tracking import MlflowClient

    from pipetune.tracking.ui_app import VIEW_KEY, first_columns, study_columns

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    eid = client.create_experiment("pipetune", artifact_location=str(tmp_path / "a"))
    client.create_experiment("someone-elses")  # no study: no view given
    old = client.create_run(eid, tags={"pipetune.kind": "study"}, start_time=1000)
    client.log_param(old.info.run_id, "objective.metric", "val_loss (min)")
    study = client.create_run(eid, tags={"pipetune.kind": "study"}, start_time=2000)
    client.log_param(study.info.run_id, "objective.metric", "accuracy (max)")
    trial = client.create_run(eid, tags={"pipetune.kind": "trial",
                                         "mlflow.parentRunId": study.info.run_id})
    for key, value in (("lr", "0.1"), ("hidden", "64"), ("seed", "7"), ("phases", "train")):
        client.log_param(trial.info.run_id, key, value)

    views = study_columns(SqlAlchemyStore(uri, str(tmp_path / "a")))
    columns = ["metrics.`accuracy`", "tags.`system.final`", "params.`hidden`", "params.`lr`",
               "tags.`outcome`"]
    assert views == {eid: {
        "selectedColumns": columns, "columnOrder": ["duration", *columns],
        "columnWidths": {"tags.`system.final`": 230},
        "runsExpanded": {study.info.run_id: True}}}  # the newest study's
    script = first_columns(views)
    key = VIEW_KEY.format(ids=f'["{eid}"]')
    assert json.dumps(key) in script and "localStorage.getItem(k)" in script
    assert first_columns({}) == ""
