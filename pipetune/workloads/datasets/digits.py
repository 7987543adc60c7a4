"""scikit-learn's bundled 8x8 digits, brought to LeNet-5's 28x28 input.

Each 8x8 image (values 0..16) is scaled to [0, 1], upsampled by nearest neighbour
to 24x24 (every pixel becomes a 3x3 block) and zero-padded by 2 pixels on each
side to 28x28, so a digit sits centred in a blank border as in MNIST. The
transform is exact and deterministic. No download: the data ships with
scikit-learn.
"""

from __future__ import annotations

import numpy as np

DIGITS_SIZE = 28


def upsample_to_28(images: np.ndarray) -> np.ndarray:
    """(N, 8, 8) in [0, 1] -> (N, 28, 28) float32: nearest x3, then pad 2."""
    if images.ndim != 3 or images.shape[1:] != (8, 8):
        raise ValueError(f"expected (N, 8, 8) images, got shape {images.shape}")
    big = images.repeat(3, axis=1).repeat(3, axis=2)
    return np.pad(big, ((0, 0), (2, 2), (2, 2))).astype(np.float32)


def load_digits_28() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 digits as (images (N, 28, 28) float32 in [0, 1], labels (N,) int64)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = bunch.images.astype(np.float32) / 16.0
    return upsample_to_28(images), bunch.target.astype(np.int64)
