"""The MLflow server app ``pipetune ui`` and an unlocked team stack serve
(``mlflow server --app-name pipetune``, an ``mlflow.app`` entry point): MLflow's own
app, whose page opens on *Model training* for a browser that never chose, with the
study's objective metric, hyperparameters and system config as columns of the runs
table of a browser that kept no view of the experiment yet.

MLflow 3's front end picks GenAI or Model training per page: from the link's
``workflowType`` if it has one, else from the browser's last choice (local storage
``mlflow.workflowType_v1``), else GenAI. It reads no experiment tag for it. pipetune's
printed links carry ``workflowType=machine_learning``, but a trial clicked in the runs
table opens without it, on GenAI. The page served here writes Model training as that
last choice where the browser has none; a choice the user makes in the UI stays theirs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

#: MLflow's local-storage key for the GenAI / Model training switch (its version 1).
WORKFLOW_KEY = "mlflow.workflowType_v1"
#: Put first in the served page's ``<head>``.
MODEL_TRAINING_FIRST = (
    f'<script>try{{if(!localStorage.getItem("{WORKFLOW_KEY}"))localStorage.setItem('
    f'"{WORKFLOW_KEY}",JSON.stringify("machine_learning"))}}catch(e){{}}</script>')


def model_training_app() -> list[str]:
    """``--app-name pipetune`` for ``mlflow server`` or ``mlflow ui`` where pipetune is
    installed with its ``mlflow.app`` entry point (``pip install``); else nothing
    (MLflow's own app)."""
    from importlib.metadata import entry_points

    names = {e.name for e in entry_points(group="mlflow.app")}
    return ["--app-name", "pipetune"] if "pipetune" in names else []


def create_app() -> Any:
    """MLflow's ASGI app (what ``mlflow server`` serves), its page opening on Model
    training."""
    from mlflow.server import app as flask_app
    from mlflow.server.fastapi_app import create_fastapi_app

    flask_app.after_request(lambda response: model_training_first(response, _store_columns))
    return create_fastapi_app(flask_app)


def model_training_first(response: Any,
                         columns: Callable[[], dict[str, dict[str, Any]]] | None = None) -> Any:
    """A Flask ``after_request`` hook: the UI's page (``index.html``) with
    :data:`MODEL_TRAINING_FIRST` in its head, and the runs table's first view
    (:func:`first_columns`, from ``columns()``: experiment id -> view); any other
    response as it is."""
    if response.status_code != 200 or response.mimetype != "text/html":
        return response
    response.direct_passthrough = False
    page = response.get_data()
    if b"<head>" not in page or WORKFLOW_KEY.encode() in page:
        return response
    script = MODEL_TRAINING_FIRST + first_columns(columns() if columns is not None else {})
    response.set_data(page.replace(b"<head>", b"<head>" + script.encode(), 1))
    return response


#: Where MLflow 3.17's front end keeps an experiment page's view (its columns among
#: it), per experiment: its ``LocalStorageStore`` scope ``ExperimentPage`` with the
#: experiment ids as JSON, version 1.1.
VIEW_KEY = "MLflowLocalStorage-1.1-ExperimentPage-{ids}-ReactComponentState"


def first_columns(views_by_id: dict[str, dict[str, Any]]) -> str:
    """A script giving each experiment's runs table its view (``selectedColumns``:
    ``metrics.`accuracy```, ``params.`lr```, ``tags.`system.final```; ...) where the
    browser keeps no view of that experiment yet (a view the user changes stays
    theirs); "" for none."""
    if not views_by_id:
        return ""
    views = {VIEW_KEY.format(ids=json.dumps([eid], separators=(",", ":"))): json.dumps(view)
             for eid, view in views_by_id.items()}
    data = json.dumps(views).replace("</", "<\\/")  # no "</script>" inside
    return ("<script>try{var v=" + data + ";for(var k in v){if(!localStorage.getItem(k))"
            "localStorage.setItem(k,v[k])}}catch(e){}</script>")


#: The hyperparameters shown as columns, at most (the first by name).
MAX_PARAM_COLUMNS = 6


def study_columns(store: Any) -> dict[str, dict[str, Any]]:
    """Experiment id -> the runs table's view for pipetune's experiments: as columns,
    the newest study's objective metric, its trials' hyperparameters, the system config
    each trial ended under and its outcome; that study's trials unfolded. Read from the
    tracking ``store``."""
    from mlflow.entities import ViewType

    found: dict[str, dict[str, Any]] = {}
    ids = [e.experiment_id for e in store.search_experiments(
        view_type=ViewType.ACTIVE_ONLY, max_results=100)]
    newest: dict[str, Any] = {}  # experiment id -> its newest study run: one query for all
    for run in (store.search_runs(ids, "tags.`pipetune.kind` = 'study'", ViewType.ACTIVE_ONLY,
                                  max_results=1000, order_by=["attributes.start_time DESC"])
                if ids else []):
        newest.setdefault(run.info.experiment_id, run)
    for eid, study in newest.items():
        metric = study.data.params.get("objective.metric", "").split(" (")[0]
        trials = store.search_runs([eid], f"tags.`mlflow.parentRunId` = '{study.info.run_id}'",
                                   ViewType.ACTIVE_ONLY, max_results=1)
        params = sorted(k for k in trials[0].data.params
                        if k not in NOT_HYPERPARAMETERS) if trials else []
        columns = [*([f"metrics.`{metric}`"] if metric else []), "tags.`system.final`",
                   *(f"params.`{p}`" for p in params[:MAX_PARAM_COLUMNS]), "tags.`outcome`"]
        found[eid] = {
            "selectedColumns": columns,
            # the config beside the metric, not after the params; the run's duration
            # ("duration": its column's id) first, where MLflow puts it
            "columnOrder": ["duration", *columns],
            "columnWidths": {"tags.`system.final`": 230},  # a config label, whole
            # the newest study's trials shown under it, not folded
            "runsExpanded": {study.info.run_id: True}}
    return found


#: A trial run's params that are not its hyperparameters.
NOT_HYPERPARAMETERS = ("seed", "phases")


def _store_columns() -> dict[str, dict[str, Any]]:
    """:func:`study_columns` of the store this server serves; {} where it cannot tell."""
    try:
        from mlflow.server.handlers import _get_tracking_store

        return study_columns(_get_tracking_store())
    except Exception:  # noqa: BLE001 - the page is served as MLflow serves it
        return {}
