"""Where state that outlives a study lives by default: the pipetune home folder, and
the MLflow store (:func:`default_tracking_uri`, re-exported by :mod:`pipetune.tracking`)."""

from __future__ import annotations

import os
from pathlib import Path

#: Environment variable that moves the home folder (tests, shared cluster stores).
HOME_ENV = "PIPETUNE_HOME"


def pipetune_home() -> Path:
    """The folder named by ``$PIPETUNE_HOME``, else ``~/.pipetune``; created on demand.

    It holds the ground truth (``groundtruth.db``) unless ``$PIPETUNE_GROUNDTRUTH`` or a
    study names another store.
    """
    from pipetune.errors import SpecError

    raw = os.environ.get(HOME_ENV, "").strip()
    home = Path(raw).expanduser() if raw else Path.home() / ".pipetune"
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecError(HOME_ENV if raw else "", f"{home} cannot be pipetune's home folder "
                        f"({e.strerror or e}); set {HOME_ENV} to a folder you can write") from None
    return home


def default_tracking_uri(cwd: str | Path | None = None) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else a SQLite file ``mlflow.db`` in the working folder."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    folder = Path(cwd or os.getcwd()).resolve()
    return f"sqlite:///{folder / 'mlflow.db'}"
