"""Reader for AG News CSV files.

Each row is ``label,title,description`` with labels 1-4 (World, Sports, Business,
Sci/Tech); an optional header row naming those columns is skipped. The text of an
article is ``title + " " + description``; labels come back 0-based.
"""

from __future__ import annotations

import csv
from pathlib import Path

from pipetune.workloads.datasets.common import DatasetError

AG_NEWS_CLASSES: tuple[str, ...] = ("World", "Sports", "Business", "Sci/Tech")


def read_ag_news(path: str | Path) -> tuple[list[str], list[int]]:
    """(texts, labels 0..3) from one AG News CSV file."""
    path = Path(path).expanduser()
    texts: list[str] = []
    labels: list[int] = []
    try:
        handle = path.open(newline="", encoding="utf-8")
    except OSError as exc:
        raise DatasetError(f"cannot read AG News CSV {path}: {exc.strerror or exc}") from exc
    with handle:
        for row_number, row in enumerate(csv.reader(handle), start=1):
            if not row:
                continue
            if row_number == 1 and row[0].strip().lower() in ("label", "class", "class index"):
                continue
            if len(row) != 3:
                raise DatasetError(
                    f"{path}:{row_number}: expected 3 columns label,title,description, "
                    f"got {len(row)}"
                )
            try:
                label = int(row[0])
            except ValueError:
                label = 0
            if not 1 <= label <= len(AG_NEWS_CLASSES):
                raise DatasetError(f"{path}:{row_number}: label must be 1-4, got {row[0]!r}")
            texts.append(f"{row[1]} {row[2]}")
            labels.append(label - 1)
    if not texts:
        raise DatasetError(f"{path} holds no AG News rows")
    return texts, labels
