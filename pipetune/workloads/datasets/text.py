"""Tokenising and encoding text for the text CNN: a regex tokenizer and a frequency vocabulary."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

PAD, UNK = "<pad>", "<unk>"
PAD_ID, UNK_ID = 0, 1

_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")


def tokenize(text: str) -> list[str]:
    """Lower-cased runs of letters and digits, keeping an apostrophe suffix (``don't``)."""
    return _TOKEN.findall(text.lower())


class Vocabulary:
    """Token -> id. Ids 0 and 1 are ``<pad>`` and ``<unk>``; the rest go by frequency.

    Ties in frequency are broken alphabetically, so the same corpus always gives the
    same ids.

    >>> Vocabulary.build([["b", "a"], ["a", "c"]], max_size=4).ids(["a", "b", "c"])
    [2, 3, 1]
    """

    def __init__(self, tokens: Sequence[str]):
        self.tokens = (PAD, UNK, *tokens)
        self._index = {t: i for i, t in enumerate(self.tokens)}

    @classmethod
    def build(cls, documents: Iterable[Sequence[str]], max_size: int) -> Vocabulary:
        """The ``max_size - 2`` most frequent tokens of ``documents`` (plus pad and unk)."""
        if max_size < 3:
            raise ValueError(f"max_size must be >= 3, got {max_size}")
        counts: Counter[str] = Counter()
        for doc in documents:
            counts.update(doc)
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return cls([t for t, _ in ranked[: max_size - 2]])

    def __len__(self) -> int:
        return len(self.tokens)

    def ids(self, tokens: Iterable[str]) -> list[int]:
        return [self._index.get(t, UNK_ID) for t in tokens]

    def encode(self, documents: Iterable[Sequence[str]], max_len: int) -> np.ndarray:
        """(N, max_len) int64 ids: each document truncated or right-padded with ``<pad>``."""
        docs = list(documents)
        out = np.full((len(docs), max_len), PAD_ID, dtype=np.int64)
        for row, doc in enumerate(docs):
            ids = self.ids(doc[:max_len])
            out[row, : len(ids)] = ids
        return out
