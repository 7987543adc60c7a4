"""The pipetune home folder: where state that outlives a study lives by default."""

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
    raw = os.environ.get(HOME_ENV, "").strip()
    home = Path(raw).expanduser() if raw else Path.home() / ".pipetune"
    home.mkdir(parents=True, exist_ok=True)
    return home
