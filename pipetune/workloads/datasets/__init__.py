"""Data loaders for the built-in workloads. Nothing here downloads anything.

- :mod:`.idx`: MNIST / Fashion-MNIST IDX files, gzipped or plain.
- :mod:`.digits`: scikit-learn's bundled 8x8 digits, brought to 28x28.
- :mod:`.newsgroups`: the 20 Newsgroups "bydate" folder tree.
- :mod:`.agnews`: AG News CSV files.
- :mod:`.corpus`: the bundled, generated 4-topic corpus.
- :mod:`.text`: tokenizer and vocabulary.

Errors in data files raise :class:`DatasetError` (a :class:`~pipetune.errors.WorkloadError`).
"""

from pipetune.workloads.datasets.agnews import AG_NEWS_CLASSES, read_ag_news
from pipetune.workloads.datasets.common import DatasetError, pool_split
from pipetune.workloads.datasets.corpus import TOPICS, topic_corpus
from pipetune.workloads.datasets.digits import load_digits_28, upsample_to_28
from pipetune.workloads.datasets.idx import (
    IMAGES_MAGIC,
    LABELS_MAGIC,
    IdxDataset,
    load_idx_dataset,
    read_idx,
    write_idx,
)
from pipetune.workloads.datasets.newsgroups import NewsgroupsData, read_newsgroups, strip_header
from pipetune.workloads.datasets.text import Vocabulary, tokenize

__all__ = [
    "AG_NEWS_CLASSES",
    "DatasetError",
    "IMAGES_MAGIC",
    "IdxDataset",
    "LABELS_MAGIC",
    "NewsgroupsData",
    "TOPICS",
    "Vocabulary",
    "load_digits_28",
    "load_idx_dataset",
    "pool_split",
    "read_ag_news",
    "read_idx",
    "read_newsgroups",
    "strip_header",
    "tokenize",
    "topic_corpus",
    "upsample_to_28",
    "write_idx",
]
