"""Links into the MLflow UI: where a study, its trials and a run are seen.

MLflow 3's experiment page opens in its GenAI view (traces, token usage) unless the URL
says ``workflowType=machine_learning``; the runs table of that view is the page
``#/experiments/<id>/runs``, which also reads a run search (``searchFilter``) from the
URL. (Read from the UI bundle of MLflow 3.17: the experiment page's own redirect keeps
``workflowType`` but drops ``searchFilter``, so the links name the ``runs`` tab.)

Pure functions on strings: no MLflow, no network.

>>> base = ui_base_url("sqlite:////work/mlflow.db")
>>> base
'http://127.0.0.1:5000'
>>> experiment_runs_url(base, "1")
'http://127.0.0.1:5000/#/experiments/1/runs?workflowType=machine_learning'
>>> run_url(base, "ab12", "1")
'http://127.0.0.1:5000/#/experiments/1/runs/ab12?workflowType=machine_learning'
"""

from __future__ import annotations

from urllib.parse import quote, urlencode, urlsplit

#: Where ``pipetune ui`` serves a store that is not a tracking server.
DEFAULT_UI_HOST = "127.0.0.1"
DEFAULT_UI_PORT = 5000

#: The query that opens MLflow 3's "Model training" view instead of its GenAI view.
MODEL_TRAINING_VIEW = {"workflowType": "machine_learning"}

#: Tag every run of a study carries (its parent run and each trial's run).
STUDY_TAG = "pipetune.study_id"


def _host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets; a wildcard bind becomes loopback
    (a browser cannot open ``0.0.0.0``)."""
    host = {"": DEFAULT_UI_HOST, "0.0.0.0": DEFAULT_UI_HOST, "::": "::1"}.get(host, host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def ui_base_url(tracking_uri: str, *, host: str = DEFAULT_UI_HOST,
                port: int = DEFAULT_UI_PORT) -> str:
    """The address of the MLflow UI that shows ``tracking_uri``'s runs.

    An http(s) tracking server serves its own UI: its address, without credentials,
    query or fragment (a path prefix is kept). Any other store (SQLite, a folder, a
    database) is seen through ``pipetune ui``, at ``host:port``.

    >>> ui_base_url("sqlite:///mlflow.db")
    'http://127.0.0.1:5000'
    >>> ui_base_url("file:///tmp/mlruns", host="0.0.0.0", port=5001)
    'http://127.0.0.1:5001'
    >>> ui_base_url("postgresql://u:p@db/mlflow", host="::1")
    'http://[::1]:5000'
    >>> ui_base_url("https://alice:s3cret@MLflow.example.org:8443/mlflow/?x=1#top")
    'https://mlflow.example.org:8443/mlflow'
    >>> ui_base_url("http://127.0.0.1:5005/")
    'http://127.0.0.1:5005'
    """
    parts = urlsplit(tracking_uri)
    if parts.scheme.lower() not in ("http", "https"):
        return f"http://{_host_port(host, port)}"
    netloc = parts.hostname or ""
    if ":" in netloc:
        netloc = f"[{netloc}]"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return f"{parts.scheme.lower()}://{netloc}{parts.path.rstrip('/')}"


def study_filter(study_id: str) -> str:
    """The MLflow run search that finds a study's runs: its parent run and its trials.

    >>> study_filter("3f2a")
    "tags.`pipetune.study_id` = '3f2a'"
    """
    if "'" in study_id or "`" in study_id:
        raise ValueError(f"study id {study_id!r}: quotes are not allowed")
    return f"tags.`{STUDY_TAG}` = '{study_id}'"


def experiment_runs_url(base: str, experiment_id: str, *,
                        search_filter: str | None = None) -> str:
    """The runs table of experiment ``experiment_id`` in the Model-training view, showing
    only the runs ``search_filter`` (MLflow's run search syntax) finds when given.

    >>> experiment_runs_url("http://127.0.0.1:5000", "7",
    ...                     search_filter="tags.`pipetune.study_id` = 's1'")
    'http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning&searchFilter=tags.%60pipetune.study_id%60+%3D+%27s1%27'
    """
    query = dict(MODEL_TRAINING_VIEW)
    if search_filter:
        query["searchFilter"] = search_filter
    return f"{base.rstrip('/')}/#/experiments/{quote(str(experiment_id), safe='')}/runs?" \
           f"{urlencode(query)}"


def study_runs_url(base: str, experiment_id: str, study_id: str) -> str:
    """The runs table filtered to one study: its parent run and its trials' runs.

    >>> study_runs_url("http://127.0.0.1:5000", "1", "s1").endswith(
    ...     "searchFilter=tags.%60pipetune.study_id%60+%3D+%27s1%27")
    True
    """
    return experiment_runs_url(base, experiment_id, search_filter=study_filter(study_id))


def run_url(base: str, run_id: str, experiment_id: str | None = None) -> str:
    """The page of run ``run_id``; without its experiment, MLflow's direct run route,
    which finds the experiment itself.

    >>> run_url("http://127.0.0.1:5000", "ab12")
    'http://127.0.0.1:5000/#/runs/ab12?workflowType=machine_learning'
    """
    path = f"runs/{quote(run_id, safe='')}"
    if experiment_id is not None:
        path = f"experiments/{quote(str(experiment_id), safe='')}/{path}"
    return f"{base.rstrip('/')}/#/{path}?{urlencode(MODEL_TRAINING_VIEW)}"


__all__ = [
    "DEFAULT_UI_HOST",
    "DEFAULT_UI_PORT",
    "MODEL_TRAINING_VIEW",
    "STUDY_TAG",
    "experiment_runs_url",
    "run_url",
    "study_filter",
    "study_runs_url",
    "ui_base_url",
]
