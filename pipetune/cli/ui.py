"""``pipetune ui``: the MLflow UI on the study store, light and on loopback.

One web worker and no job runner (MLflow 3's default is four uvicorn workers and a
GenAI job runner of several huey processes: about 3 GB resident on a 2-core machine,
none of it used to browse studies). "ready" is printed once the server answers HTTP,
followed by the link that opens the runs table in MLflow's Model-training view
(:mod:`pipetune.tracking.links`); ``--study`` narrows it to one study's runs.

A store that is an http(s) tracking server serves its own UI: nothing is started, the
link is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from pipetune.errors import PipetuneError, Stopped

#: Seconds the server may take to answer before ``pipetune ui`` gives up.
READY_TIMEOUT_S = 90.0
#: Seconds the server has to stop after Ctrl-C before what is left of it is killed.
STOP_GRACE_S = 10.0


def _raise_stop(signum, _frame) -> None:
    """SIGTERM or SIGHUP to ``pipetune ui``: stop the server as Ctrl-C does."""
    raise Stopped(signum)


def run_ui(args: argparse.Namespace) -> int:
    from pipetune.tracking import DEFAULT_EXPERIMENT, default_tracking_uri
    from pipetune.tracking.links import ui_base_url

    uri = args.tracking_uri or default_tracking_uri()
    experiment = args.experiment or DEFAULT_EXPERIMENT
    if urllib.parse.urlsplit(uri).scheme.lower() in ("http", "https"):
        base = ui_base_url(uri)
        print(f"MLflow UI of the tracking server {base} (nothing to start here)", flush=True)
        try:
            print(_target(_Rest.for_server(uri), base, experiment, args.study)[0], flush=True)
        except (OSError, PipetuneError) as e:
            print(f"{base}  (could not ask the server for the study: {e})", flush=True)
        return 0
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        raise PipetuneError(f"no MLflow store at {uri}: run `pipetune tune JOB.yaml` here first")

    from pipetune.net import port_free

    if not port_free(args.host, args.port):
        raise PipetuneError(f"--port: {args.host}:{args.port} is in use (another `pipetune ui` "
                            "or MLflow server?): pass another --port")
    from pipetune.cli.ui_prefect import PrefectUi

    base = ui_base_url(uri, host=args.host, port=args.port)
    started = time.monotonic()
    server = subprocess.Popen(_server_argv(uri, args.host, args.port), env=_server_env())
    prefect = PrefectUi.begin() if args.prefect else None
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        _wait_ready(server, base, args.ready_timeout)
        print(f"MLflow UI ready on {base} in {time.monotonic() - started:.1f} s "
              f"(store {uri}); Ctrl-C stops it", flush=True)
        flow_run_id = None
        try:
            line, flow_run_id = _target(_Rest(base), base, experiment, args.study)
            print(line, flush=True)
        except (OSError, PipetuneError) as e:
            print(f"{base}  ({e})", flush=True)
        if prefect is not None:
            print("\n".join(prefect.lines(flow_run_id, args.ready_timeout)), flush=True)
        return server.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        if prefect is not None:
            prefect.stop()
        # A second Ctrl-C does not cut the stop short: it is bounded (STOP_GRACE_S).
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            _stop(server)
        finally:
            signal.signal(signal.SIGINT, interrupt)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _server_argv(uri: str, host: str, port: int) -> list[str]:
    from pipetune.tracking.ui_app import model_training_app

    mlflow_bin = Path(sys.executable).with_name("mlflow")
    return [str(mlflow_bin if mlflow_bin.exists() else "mlflow"), "ui",
            "--backend-store-uri", uri, "--host", host, "--port", str(port), "--workers", "1",
            # one line per request (dozens per page) would bury "ready" and the link
            "--uvicorn-opts", "--no-access-log", *model_training_app()]


def _server_env() -> dict[str, str]:
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    # MLflow 3's job runner (GenAI scorers, a huey consumer and its workers): unused here.
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    return env


def _wait_ready(server: subprocess.Popen, base: str, timeout_s: float) -> None:
    """Return once ``base/health`` answers 200; raise if the server exits or is slow."""
    deadline = time.monotonic() + timeout_s
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback
    while True:
        code = server.poll()
        if code is not None:
            raise PipetuneError(f"the MLflow UI server exited ({code}) before it answered; "
                                "its output is above")
        try:
            with opener.open(f"{base}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (OSError, ValueError):
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise PipetuneError(f"the MLflow UI server did not answer on {base} within "
                                f"{timeout_s:.0f} s (--ready-timeout)")
        time.sleep(0.1)


def _stop(server: subprocess.Popen) -> None:
    """SIGINT to the server (it forwards it to its web worker), then SIGKILL to whatever
    of its tree is left after :data:`STOP_GRACE_S`."""
    import psutil

    try:
        root = psutil.Process(server.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
    _, left = psutil.wait_procs(tree, timeout=STOP_GRACE_S)
    for proc in left:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=5)
    server.wait()


class _Rest:
    """A few calls of MLflow's REST API, with the standard library: the UI process stays
    small and starts at once (no MLflow import here)."""

    def __init__(self, api_base: str, headers: dict[str, str] | None = None, *,
                 proxies: bool = False):
        self.api = api_base.rstrip("/") + "/api/2.0/mlflow"
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self._open = (urllib.request.urlopen if proxies else
                      urllib.request.build_opener(urllib.request.ProxyHandler({})).open)

    @classmethod
    def for_server(cls, tracking_uri: str) -> _Rest:
        """A tracking server's API, with the credentials MLflow's client would send:
        those in the URI, else ``MLFLOW_TRACKING_USERNAME``/``_PASSWORD`` or
        ``MLFLOW_TRACKING_TOKEN``."""
        import base64

        from pipetune.tracking.links import ui_base_url

        parts = urllib.parse.urlsplit(tracking_uri)
        user = urllib.parse.unquote(parts.username or "") or os.environ.get(
            "MLFLOW_TRACKING_USERNAME", "")
        password = urllib.parse.unquote(parts.password or "") or os.environ.get(
            "MLFLOW_TRACKING_PASSWORD", "")
        headers = {}
        if user:
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            headers["Authorization"] = f"Basic {token}"
        elif os.environ.get("MLFLOW_TRACKING_TOKEN"):
            headers["Authorization"] = f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}"
        return cls(ui_base_url(tracking_uri), headers, proxies=True)

    def get(self, path: str, **query: str) -> dict:
        return self._call(urllib.request.Request(
            f"{self.api}/{path}?{urllib.parse.urlencode(query)}", headers=self.headers))

    def post(self, path: str, body: dict) -> dict:
        return self._call(urllib.request.Request(
            f"{self.api}/{path}", data=json.dumps(body).encode(), headers=self.headers,
            method="POST"))

    def _call(self, request: urllib.request.Request) -> dict:
        try:
            with self._open(request, timeout=30) as answer:
                return json.loads(answer.read() or b"{}")
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return {}
            raise


def _target(rest: _Rest, base: str, experiment: str,
            study: str | None) -> tuple[str, str | None]:
    """The line naming what to open: the experiment's runs table, or with ``study``
    (``latest``, a study id or a run id) that study's runs and its parent run; and the
    study's Prefect flow run id, where its run has one."""
    from pipetune.tracking.links import experiment_runs_url, run_url, study_runs_url

    found = rest.get("experiments/get-by-name", experiment_name=experiment).get("experiment")
    if not found:
        raise PipetuneError(f"no experiment {experiment!r} in this store yet")
    experiment_id = found["experiment_id"]
    if study is None:
        return (f"runs of experiment {experiment}: {experiment_runs_url(base, experiment_id)}",
                None)
    run = _study_run(rest, experiment_id, study)
    if run is None:
        return (f"no study {study!r} in experiment {experiment}; its runs: "
                f"{experiment_runs_url(base, experiment_id)}", None)
    tags = {t["key"]: t["value"] for t in run["data"].get("tags", [])}
    run_id = run["info"]["run_id"]
    study_id = tags.get("pipetune.study_id")
    runs = (study_runs_url(base, experiment_id, study_id) if study_id
            else experiment_runs_url(base, experiment_id))
    return (f"study {study_id or '?'} (run {run_id}): {runs}\n"
            f"  its run: {run_url(base, run_id, experiment_id)}", tags.get("prefect.flow_run_id"))


def _study_run(rest: _Rest, experiment_id: str, study: str) -> dict | None:
    """The parent run of ``study``: the newest (``latest``), the one tagged with that
    study id, or the run of that id (a trial's run leads to its study's run)."""
    def search(filter_string: str) -> dict | None:
        runs = rest.post("runs/search", {
            "experiment_ids": [experiment_id], "filter": filter_string, "max_results": 1,
            "order_by": ["attributes.start_time DESC"]}).get("runs", [])
        return runs[0] if runs else None

    kind = "tags.`pipetune.kind` = 'study'"
    if study == "latest":
        return search(kind)
    if "'" in study or "`" in study:
        raise PipetuneError(f"--study: {study!r} is not a study id or run id")
    run = search(f"{kind} and tags.`pipetune.study_id` = '{study}'")
    if run is not None:
        return run
    run = rest.get("runs/get", run_id=study).get("run")
    if run is None:
        return None
    tags = {t["key"]: t["value"] for t in run["data"].get("tags", [])}
    if tags.get("pipetune.kind") == "trial" and tags.get("mlflow.parentRunId"):
        return rest.get("runs/get", run_id=tags["mlflow.parentRunId"]).get("run")
    return run


def add_ui(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "ui", help="open the MLflow UI on the study store",
        description="Serve the MLflow UI of the study store (one web worker, on 127.0.0.1 "
        "unless --host says otherwise) and print, once it answers, the link to the runs "
        "table in MLflow's Model-training view. With an http(s) --tracking-uri, print "
        "the link into that server's UI.")
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow store (default: $MLFLOW_TRACKING_URI, else ./mlflow.db)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--study", default=None, metavar="latest|STUDY_ID|RUN_ID",
                   help="link that study's runs (its run and its trials) instead of the "
                   "whole runs table; `latest`: the newest study")
    p.add_argument("--experiment", default=None, help="experiment (default: pipetune)")
    p.add_argument("--no-prefect", dest="prefect", action="store_false",
                   help="the MLflow UI alone (by default the Prefect UI of the studies' flow "
                   "runs too: your PREFECT_API_URL's, this folder's warm service's, or one "
                   "started here over the pipetune home's Prefect database)")
    p.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_S,
                   help=f"seconds to wait for the server to answer (default "
                   f"{READY_TIMEOUT_S:.0f})")
    p.set_defaults(run=run_ui)
