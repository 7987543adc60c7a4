"""Reader for the IDX format of MNIST and Fashion-MNIST (gzipped or plain).

An IDX file starts with a 4-byte magic number: two zero bytes, a type code (``0x08``
unsigned byte, ``0x09`` signed byte, ``0x0B`` int16, ``0x0C`` int32, ``0x0D`` float32,
``0x0E`` float64) and the number of dimensions; then one big-endian uint32 per
dimension, then the data, big-endian, row-major. MNIST images are magic 2051
(``0x00000803``: ubyte, 3 dims) and labels 2049 (``0x00000801``: ubyte, 1 dim).
"""

from __future__ import annotations

import gzip
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipetune.workloads.datasets.common import DatasetError

IMAGES_MAGIC = 2051
LABELS_MAGIC = 2049

_DTYPES: dict[int, str] = {
    0x08: "u1",
    0x09: "i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}


def read_idx(path: str | Path, expect_magic: int | None = None) -> np.ndarray:
    """Read one IDX file (gzip is detected from its content, not its name).

    ``expect_magic`` (e.g. :data:`IMAGES_MAGIC`) rejects a file of another kind.
    Raises :class:`DatasetError` naming the file when it is missing, truncated or
    not IDX.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"cannot read IDX file {path}: {exc.strerror or exc}") from exc
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise DatasetError(f"{path} looks gzipped but does not decompress: {exc}") from exc
    if len(raw) < 4:
        raise DatasetError(f"{path} is too short to be an IDX file ({len(raw)} bytes)")
    (magic,) = struct.unpack(">I", raw[:4])
    zero, type_code, ndim = magic >> 16, (magic >> 8) & 0xFF, magic & 0xFF
    if zero != 0 or type_code not in _DTYPES or ndim == 0:
        raise DatasetError(
            f"{path} is not an IDX file: bad magic number {magic} (0x{magic:08x}); expected "
            f"{IMAGES_MAGIC} for images or {LABELS_MAGIC} for labels"
        )
    if expect_magic is not None and magic != expect_magic:
        raise DatasetError(f"{path}: magic number {magic}, expected {expect_magic}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetError(f"{path} is truncated inside its IDX header")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(_DTYPES[type_code])
    count = int(np.prod(shape, dtype=np.int64))
    if len(raw) - header != count * dtype.itemsize:
        raise DatasetError(
            f"{path}: header says shape {tuple(shape)} ({count * dtype.itemsize} bytes of data) "
            f"but the file holds {len(raw) - header}"
        )
    data = np.frombuffer(raw, dtype=dtype, count=count, offset=header)
    return data.reshape(shape).astype(dtype.newbyteorder("="), copy=True)


@dataclass(frozen=True)
class IdxDataset:
    """Images (N, rows, cols) and labels (N,) of a train pair and, if present, a test pair."""

    train_images: np.ndarray | None
    train_labels: np.ndarray | None
    test_images: np.ndarray | None
    test_labels: np.ndarray | None


def _find(data_dir: Path, stem: str) -> Path | None:
    # Both the original names (train-images-idx3-ubyte) and the dotted variant some
    # mirrors use (train-images.idx3-ubyte) are accepted, gzipped or not.
    kind, rest = stem.split("-idx")
    for name in (stem, f"{kind}.idx{rest}"):
        for suffix in (".gz", ""):
            candidate = data_dir / f"{name}{suffix}"
            if candidate.is_file():
                return candidate
    return None


def _read_pair(data_dir: Path, prefix: str) -> tuple[np.ndarray, np.ndarray] | None:
    images_path = _find(data_dir, f"{prefix}-images-idx3-ubyte")
    labels_path = _find(data_dir, f"{prefix}-labels-idx1-ubyte")
    if images_path is None and labels_path is None:
        return None
    if images_path is None or labels_path is None:
        missing = "images" if images_path is None else "labels"
        raise DatasetError(
            f"{data_dir}: found the {prefix} pair's other file but not its {missing}"
        )
    images = read_idx(images_path, IMAGES_MAGIC)
    labels = read_idx(labels_path, LABELS_MAGIC)
    if len(images) != len(labels):
        raise DatasetError(
            f"{images_path.name} holds {len(images)} images but {labels_path.name} "
            f"{len(labels)} labels"
        )
    return images, labels


def load_idx_dataset(data_dir: str | Path) -> IdxDataset:
    """Read ``train-*`` and ``t10k-*`` IDX pairs from ``data_dir`` (at least one must exist)."""
    data_dir = Path(data_dir).expanduser()
    if not data_dir.is_dir():
        raise DatasetError(f"IDX data_dir {data_dir} is not a folder")
    train = _read_pair(data_dir, "train")
    test = _read_pair(data_dir, "t10k")
    if train is None and test is None:
        raise DatasetError(
            f"{data_dir} holds no IDX pair: expected train-images-idx3-ubyte[.gz] with "
            f"train-labels-idx1-ubyte[.gz], or the t10k-* pair"
        )
    return IdxDataset(
        train_images=train[0] if train else None,
        train_labels=train[1] if train else None,
        test_images=test[0] if test else None,
        test_labels=test[1] if test else None,
    )


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write ``array`` as an IDX file (gzipped when ``path`` ends in ``.gz``)."""
    array = np.asarray(array)
    codes = {np.dtype(v).newbyteorder("=").str: k for k, v in _DTYPES.items()}
    native = array.dtype.newbyteorder("=")
    if native.str not in codes:
        raise DatasetError(f"IDX cannot hold dtype {array.dtype}")
    type_code = codes[native.str]
    big = array.astype(np.dtype(_DTYPES[type_code]), copy=False)
    payload = struct.pack(">I", (type_code << 8) | array.ndim)
    payload += struct.pack(f">{array.ndim}I", *array.shape) + big.tobytes()
    path = Path(path)
    path.write_bytes(gzip.compress(payload) if path.suffix == ".gz" else payload)
