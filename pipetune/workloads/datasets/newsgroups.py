"""Reader for the 20 Newsgroups "bydate" folder layout.

``data_dir/20news-bydate-train/<category>/<numbered files>`` and the same under
``20news-bydate-test``. Files are read as latin-1; each message's header (everything
up to the first blank line) is dropped. Categories are the sorted folder names of
the training split and label ``i`` is the ``i``-th of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipetune.workloads.datasets.common import DatasetError

TRAIN_FOLDER = "20news-bydate-train"
TEST_FOLDER = "20news-bydate-test"


@dataclass(frozen=True)
class NewsgroupsData:
    categories: tuple[str, ...]
    train_texts: list[str]
    train_labels: list[int]
    #: Empty when the tree has no test folder (the caller then splits the training part).
    test_texts: list[str]
    test_labels: list[int]


def strip_header(message: str) -> str:
    """The body of a news message: what follows the first blank line (all of it if none)."""
    text = message.replace("\r\n", "\n")
    _, sep, body = text.partition("\n\n")
    return body if sep else text


def _file_order(path: Path) -> tuple[int, int | str]:
    return (0, int(path.name)) if path.name.isdigit() else (1, path.name)


def _read_split(folder: Path, categories: tuple[str, ...]) -> tuple[list[str], list[int]]:
    texts: list[str] = []
    labels: list[int] = []
    for label, category in enumerate(categories):
        cat_dir = folder / category
        if not cat_dir.is_dir():
            continue
        for file in sorted((p for p in cat_dir.iterdir() if p.is_file()), key=_file_order):
            texts.append(strip_header(file.read_text(encoding="latin-1")))
            labels.append(label)
    return texts, labels


def read_newsgroups(data_dir: str | Path) -> NewsgroupsData:
    """Read the bydate tree under ``data_dir``; the test folder is optional."""
    data_dir = Path(data_dir).expanduser()
    train_dir = data_dir / TRAIN_FOLDER
    if not train_dir.is_dir():
        raise DatasetError(
            f"{data_dir} has no {TRAIN_FOLDER}/ folder (20 Newsgroups bydate layout)"
        )
    categories = tuple(sorted(p.name for p in train_dir.iterdir() if p.is_dir()))
    if len(categories) < 2:
        raise DatasetError(
            f"{train_dir} needs at least two category folders, found {len(categories)}"
        )
    train_texts, train_labels = _read_split(train_dir, categories)
    if not train_texts:
        raise DatasetError(f"{train_dir} holds no message files")
    test_texts: list[str] = []
    test_labels: list[int] = []
    test_dir = data_dir / TEST_FOLDER
    if test_dir.is_dir():
        extra = sorted({p.name for p in test_dir.iterdir() if p.is_dir()} - set(categories))
        if extra:
            raise DatasetError(
                f"{test_dir} has categories missing from the training split: {extra}"
            )
        test_texts, test_labels = _read_split(test_dir, categories)
    return NewsgroupsData(categories, train_texts, train_labels, test_texts, test_labels)
