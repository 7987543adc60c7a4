"""Where a ground truth lives: a path or a URL, and the store that serves it.

- ``postgresql://...`` or ``postgresql+psycopg://...`` (psycopg 3 either way), or
  ``sqlite:///FILE``: a :class:`~pipetune.groundtruth.sql.SqlStore`;
- a path ending in ``.json``: the JSON file of
  :class:`~pipetune.groundtruth.store.JsonStore` (also the import/export format);
- any other path: a SQLite file at that path.

No location: ``$PIPETUNE_GROUNDTRUTH`` (a URL or path) when set, else
``sqlite:///<pipetune home>/groundtruth.db``, which imports the home's old
``groundtruth.json`` once, the first time it is found empty.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipetune.errors import GroundTruthError
from pipetune.groundtruth.store import JsonStore
from pipetune.home import pipetune_home

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

    from pipetune.groundtruth.sql import SqlStore

#: Environment variable naming the default ground truth (a URL or a path).
GROUNDTRUTH_ENV = "PIPETUNE_GROUNDTRUTH"


def is_url(location: Any) -> bool:
    """Whether ``location`` is a database URL rather than a file path."""
    return not isinstance(location, Path) and "://" in str(location)


def open_store(location: str | Path | None) -> JsonStore | SqlStore:
    """The store at ``location`` (see the module's rules); ``None``: the default."""
    from pipetune.groundtruth.sql import SqlStore

    if location is None:
        chosen = os.environ.get(GROUNDTRUTH_ENV, "").strip()
        if chosen:
            return open_store(chosen)
        home = pipetune_home()
        return SqlStore(_sqlite(home / "groundtruth.db"), legacy=home / "groundtruth.json")
    if not isinstance(location, str | Path) or not str(location).strip():
        raise GroundTruthError(f"a ground-truth location is a path or a URL, got {location!r}")
    if is_url(location):
        return SqlStore(str(location))
    path = Path(location).expanduser()
    if path.suffix.lower() == ".json":
        return JsonStore(path)
    return SqlStore(_sqlite(path.absolute()))


def _sqlite(path: Path) -> URL:
    from sqlalchemy.engine import URL

    return URL.create("sqlite", database=str(path))
