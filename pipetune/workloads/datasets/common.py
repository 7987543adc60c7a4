"""Shared by every loader: the dataset error and seeded train / validation selection."""

from __future__ import annotations

import numpy as np

from pipetune.errors import SpecError, WorkloadError


class DatasetError(WorkloadError):
    """A data file or folder is missing or not in the format its loader reads."""


#: Share of a single pool held out for validation when no size is given.
DEFAULT_VAL_FRACTION = 0.2


def permutation(n: int, seed: int) -> np.ndarray:
    """A permutation of ``range(n)`` that depends only on ``n`` and ``seed``."""
    return np.random.default_rng(seed).permutation(n)


def pool_split(
    n: int,
    train_samples: int | None,
    val_samples: int | None,
    seed: int,
    field: str = "workload.params",
) -> tuple[np.ndarray, np.ndarray]:
    """Split one pool of ``n`` items into (train indices, val indices), seeded.

    The validation part is the head of a seeded permutation and the training part
    follows it, so a given ``val_samples`` keeps the same validation items whatever
    ``train_samples`` is. Without sizes, 20% is held out and the rest trains.
    """
    if val_samples is None:
        val_samples = max(1, round(n * DEFAULT_VAL_FRACTION))
        if train_samples is not None:
            val_samples = min(val_samples, n - train_samples)
    if train_samples is None:
        train_samples = n - val_samples
    if train_samples < 1 or val_samples < 1 or train_samples + val_samples > n:
        raise SpecError(
            field,
            f"train_samples={train_samples} + val_samples={val_samples} needs more than the "
            f"{n} examples available (each must be >= 1)",
        )
    order = permutation(n, seed)
    return order[val_samples : val_samples + train_samples], order[:val_samples]


def head(n: int, wanted: int | None, seed: int, field: str) -> np.ndarray:
    """``wanted`` seeded indices out of ``n`` (all ``n``, shuffled, when ``wanted`` is None)."""
    if wanted is None:
        wanted = n
    if wanted < 1 or wanted > n:
        raise SpecError(field, f"must be between 1 and {n} (examples available), got {wanted}")
    return permutation(n, seed)[:wanted]
