"""A Kim (2014) style text CNN on topic classification: the built-in workload ``textcnn``.

Model: embedding -> 1-D convolutions of widths 3, 4 and 5 (``num_filters`` each) ->
ReLU -> max-pool over time -> dropout -> linear. Dropout masks come from the
workload's seeded generator (see :mod:`pipetune.workloads._classifier`).

Params (``workload.params`` in a job file):

- ``dataset``:

  - ``"bundled"`` (default): a 4-topic corpus generated in code from word lists
    written for pipetune (:mod:`pipetune.workloads.datasets.corpus`): Zipf-like
    sampling of shared and topic words, some words shared by two topics, 5% label
    noise. Seeded by ``data_seed``; nothing is read from disk. Default sizes: 2,000
    training and 500 validation documents.
  - ``"20newsgroups"``: the "bydate" tree under ``data_dir``
    (``20news-bydate-train/<category>/<files>``, optional ``20news-bydate-test``).
  - ``"ag_news"``: AG News CSV (``label,title,description``, labels 1-4): ``path`` to
    one file, or ``data_dir`` holding ``train.csv`` and/or ``test.csv``.

  When only one pool of examples exists, a seeded split holds out 20% (or
  ``val_samples``) for validation.
- ``train_samples`` / ``val_samples``: how many examples to use (seeded choice).
- ``max_len`` (64): tokens kept per document, padded or truncated.
- ``vocab_size`` (5000): vocabulary size including ``<pad>`` and ``<unk>``, built
  from the training split by frequency (ties alphabetical).
- ``data_seed`` (0).

Hyperparameters: ``lr`` (Adam, default 1e-3), ``batch_size`` (64), ``embed_dim``
(64), ``dropout`` (0.3), ``num_filters`` (32).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from pipetune.errors import SpecError
from pipetune.workloads._classifier import ClassifierData, HParam, TorchClassifierWorkload
from pipetune.workloads._seeded import seeded_dropout

DATASETS: tuple[str, ...] = ("bundled", "20newsgroups", "ag_news")
FILTER_WIDTHS: tuple[int, ...] = (3, 4, 5)
BUNDLED_TRAIN, BUNDLED_VAL = 2000, 500


class TextCNN(nn.Module):
    """Embedding, parallel 1-D convolutions, max over time, dropout, linear."""

    def __init__(
        self, vocab_size: int, embed_dim: int, num_filters: int, num_classes: int, dropout: float
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=0)
        self.convs = nn.ModuleList(nn.Conv1d(embed_dim, num_filters, w) for w in FILTER_WIDTHS)
        self.classifier = nn.Linear(num_filters * len(FILTER_WIDTHS), num_classes)
        self.dropout = dropout
        #: CPU generator for dropout masks (the workload's); None uses torch's global RNG.
        self.generator: torch.Generator | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids).transpose(1, 2)
        features = torch.cat([torch.relu(conv(x)).amax(dim=2) for conv in self.convs], dim=1)
        if self.training:
            features = seeded_dropout(features, self.dropout, self.generator)
        return self.classifier(features)


def _ag_news_pools(data_dir: str | None, path: str | None) -> tuple[Path | None, Path | None]:
    from pipetune.workloads.datasets import DatasetError

    if path is not None:
        return Path(path), None
    assert data_dir is not None
    train, test = Path(data_dir) / "train.csv", Path(data_dir) / "test.csv"
    found = [p if p.is_file() else None for p in (train, test)]
    if found == [None, None]:
        raise DatasetError(f"{data_dir} holds neither train.csv nor test.csv (AG News)")
    return found[0], found[1]


@functools.lru_cache(maxsize=4)
def load_text_data(
    dataset: str,
    data_dir: str | None,
    path: str | None,
    train_samples: int | None,
    val_samples: int | None,
    max_len: int,
    vocab_size: int,
    data_seed: int,
) -> ClassifierData:
    """Token ids (N, max_len) int64 and labels; ``extra`` holds ``vocab_size`` and
    ``classes``. Cached per process."""
    from pipetune.workloads.datasets import (
        AG_NEWS_CLASSES,
        TOPICS,
        Vocabulary,
        read_ag_news,
        read_newsgroups,
        tokenize,
        topic_corpus,
    )
    from pipetune.workloads.datasets.common import head, pool_split

    sizes_field = "workload.params.train_samples"
    val_field = "workload.params.val_samples"

    def pick(texts: list[str], labels: list[int], index: Any) -> tuple[list[str], list[int]]:
        return [texts[i] for i in index], [labels[i] for i in index]

    def two_pools(a: tuple[list[str], list[int]], b: tuple[list[str], list[int]]) -> Any:
        tr = head(len(a[0]), train_samples, data_seed, sizes_field)
        va = head(len(b[0]), val_samples, data_seed, val_field)
        return pick(*a, tr), pick(*b, va)

    def one_pool(a: tuple[list[str], list[int]]) -> Any:
        tr, va = pool_split(len(a[0]), train_samples, val_samples, data_seed, sizes_field)
        return pick(*a, tr), pick(*a, va)

    if dataset == "bundled":
        train = topic_corpus(train_samples or BUNDLED_TRAIN, data_seed, "train")
        val = topic_corpus(val_samples or BUNDLED_VAL, data_seed, "val")
        classes: tuple[str, ...] = TOPICS
    elif dataset == "20newsgroups":
        assert data_dir is not None
        ng = read_newsgroups(data_dir)
        pool = (ng.train_texts, ng.train_labels)
        if ng.test_texts:
            train, val = two_pools(pool, (ng.test_texts, ng.test_labels))
        else:
            train, val = one_pool(pool)
        classes = ng.categories
    else:
        first, second = _ag_news_pools(data_dir, path)
        if first is not None and second is not None:
            train, val = two_pools(read_ag_news(first), read_ag_news(second))
        else:
            only = first or second
            assert only is not None
            train, val = one_pool(read_ag_news(only))
        classes = AG_NEWS_CLASSES

    train_tokens = [tokenize(t) for t in train[0]]
    vocab = Vocabulary.build(train_tokens, vocab_size)
    val_tokens = [tokenize(t) for t in val[0]]
    return ClassifierData(
        train_x=torch.from_numpy(vocab.encode(train_tokens, max_len)),
        train_y=torch.tensor(train[1], dtype=torch.int64),
        val_x=torch.from_numpy(vocab.encode(val_tokens, max_len)),
        val_y=torch.tensor(val[1], dtype=torch.int64),
        num_classes=len(classes),
        extra={"vocab_size": len(vocab), "classes": classes},
    )


class TextCNNWorkload(TorchClassifierWorkload):
    """Text CNN on the bundled corpus, 20 Newsgroups or AG News; see the module doc.

    >>> w = TextCNNWorkload(train_samples=100, val_samples=40)
    >>> w.setup({"batch_size": 16}, seed=0)
    >>> w.batch_size
    16
    """

    name: ClassVar[str] = "textcnn"
    metrics: ClassVar[tuple[str, ...]] = ("accuracy", "val_loss")
    hparam_specs: ClassVar[dict[str, HParam]] = {
        "lr": HParam(1e-3),
        "batch_size": HParam(64, int),
        "embed_dim": HParam(64, int),
        "dropout": HParam(0.3, float, 0.0, low_open=False, high=1.0),
        "num_filters": HParam(32, int),
    }
    param_defaults: ClassVar[dict[str, Any]] = {
        "dataset": "bundled",
        "data_dir": None,
        "path": None,
        "train_samples": None,
        "val_samples": None,
        "max_len": 64,
        "vocab_size": 5000,
        "data_seed": 0,
    }

    def _check_params(self) -> None:
        s = self.settings
        self._choice_param("dataset", DATASETS)
        for name in ("train_samples", "val_samples"):
            self._int_param(name)
        self._int_param("max_len", minimum=max(FILTER_WIDTHS), optional=False)
        self._int_param("vocab_size", minimum=3, optional=False)
        self._int_param("data_seed", minimum=0, optional=False)
        for name in ("data_dir", "path"):
            if s[name] is not None:
                s[name] = str(Path(s[name]).expanduser())
        if s["dataset"] == "bundled":
            for name in ("data_dir", "path"):
                if s[name] is not None:
                    raise SpecError(f"workload.params.{name}", "is not used with dataset: bundled")
        elif s["dataset"] == "20newsgroups" and s["data_dir"] is None:
            raise SpecError(
                "workload.params.data_dir",
                "is required with dataset: 20newsgroups (the folder holding 20news-bydate-train)",
            )
        elif s["dataset"] == "ag_news" and (s["data_dir"] is None) == (s["path"] is None):
            raise SpecError(
                "workload.params.path",
                "dataset ag_news needs exactly one of path (a CSV file) or data_dir "
                "(a folder with train.csv and/or test.csv)",
            )

    def _load_data(self) -> ClassifierData:
        s = self.settings
        return load_text_data(
            s["dataset"],
            s["data_dir"],
            s["path"],
            s["train_samples"],
            s["val_samples"],
            s["max_len"],
            s["vocab_size"],
            s["data_seed"],
        )

    def _build_model(self, data: ClassifierData, hparams: Mapping[str, Any]) -> nn.Module:
        model = TextCNN(
            vocab_size=int(data.extra["vocab_size"]),
            embed_dim=hparams["embed_dim"],
            num_filters=hparams["num_filters"],
            num_classes=data.num_classes,
            dropout=hparams["dropout"],
        )
        model.generator = self._rng
        return model

    def _build_optimizer(
        self, model: nn.Module, hparams: Mapping[str, Any]
    ) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=hparams["lr"])
