"""The MLflow server app ``pipetune ui`` and an unlocked team stack serve
(``mlflow server --app-name pipetune``, an ``mlflow.app`` entry point): MLflow's own
app, whose page opens on *Model training* for a browser that never chose.

MLflow 3's front end picks GenAI or Model training per page: from the link's
``workflowType`` if it has one, else from the browser's last choice (local storage
``mlflow.workflowType_v1``), else GenAI. It reads no experiment tag for it. pipetune's
printed links carry ``workflowType=machine_learning``, but a trial clicked in the runs
table opens without it, on GenAI. The page served here writes Model training as that
last choice where the browser has none; a choice the user makes in the UI stays theirs.
"""

from __future__ import annotations

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

    flask_app.after_request(model_training_first)
    return create_fastapi_app(flask_app)


def model_training_first(response: Any) -> Any:
    """A Flask ``after_request`` hook: the UI's page (``index.html``) with
    :data:`MODEL_TRAINING_FIRST` in its head; any other response as it is."""
    if response.status_code != 200 or response.mimetype != "text/html":
        return response
    response.direct_passthrough = False
    page = response.get_data()
    if b"<head>" not in page or WORKFLOW_KEY.encode() in page:
        return response
    response.set_data(page.replace(b"<head>", b"<head>" + MODEL_TRAINING_FIRST.encode(), 1))
    return response
