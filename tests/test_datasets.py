"""Data loaders of the built-in workloads, on small files the tests write and on real data."""

from __future__ import annotations

import csv
import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from pipetune.errors import SpecError, WorkloadError
from pipetune.workloads.datasets import (
    DatasetError,
    Vocabulary,
    load_digits_28,
    load_idx_dataset,
    pool_split,
    read_ag_news,
    read_idx,
    read_newsgroups,
    strip_header,
    tokenize,
    topic_corpus,
    upsample_to_28,
    write_idx,
)


def _idx_bytes(array: np.ndarray, magic: int) -> bytes:
    """IDX bytes written by hand (not by the library's writer): magic, dims, data."""
    header = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def _write_mnist_like(folder: Path, prefix: str, n: int, gz: bool, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = (np.arange(n) % 10).astype(np.uint8)
    for kind, array, magic, dims in (("images", images, 2051, 3), ("labels", labels, 2049, 1)):
        name = folder / f"{prefix}-{kind}-idx{dims}-ubyte{'.gz' if gz else ''}"
        payload = _idx_bytes(array, magic)
        name.write_bytes(gzip.compress(payload) if gz else payload)
    return images, labels


# -- IDX ------------------------------------------------------------------------------
@pytest.mark.parametrize("gz", [False, True])
def test_idx_reader_reads_plain_and_gzipped_pairs(tmp_path, gz):
    images, labels = _write_mnist_like(tmp_path, "t10k", 12, gz)
    data = load_idx_dataset(tmp_path)
    assert data.train_images is None and data.train_labels is None
    assert data.test_images.shape == (12, 28, 28) and data.test_images.dtype == np.uint8
    np.testing.assert_array_equal(data.test_images, images)
    np.testing.assert_array_equal(data.test_labels, labels)


def test_idx_reader_rejects_bad_magic_and_wrong_kind(tmp_path):
    bad = tmp_path / "bad-idx3-ubyte"
    bad.write_bytes(b"\x01\x02\x08\x03" + b"\x00" * 16)
    with pytest.raises(DatasetError, match="bad magic number") as info:
        read_idx(bad)
    assert isinstance(info.value, WorkloadError) and "bad-idx3-ubyte" in str(info.value)

    labels = tmp_path / "labels-idx1-ubyte"
    labels.write_bytes(_idx_bytes(np.arange(5), 2049))
    with pytest.raises(DatasetError, match="magic number 2049, expected 2051"):
        read_idx(labels, expect_magic=2051)


def test_idx_reader_rejects_truncated_data(tmp_path):
    path = tmp_path / "short-idx1-ubyte"
    path.write_bytes(_idx_bytes(np.arange(10), 2049)[:-3])
    with pytest.raises(DatasetError, match="holds 7"):
        read_idx(path)


def test_idx_writer_round_trips_other_dtypes(tmp_path):
    for array in (np.arange(24, dtype=np.int32).reshape(2, 3, 4), np.linspace(0, 1, 7)):
        path = tmp_path / f"a-{array.dtype}.idx.gz"
        write_idx(path, array)
        np.testing.assert_array_equal(read_idx(path), array)


def test_idx_folder_needs_a_complete_pair(tmp_path):
    with pytest.raises(DatasetError, match="holds no IDX pair"):
        load_idx_dataset(tmp_path)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(
        _idx_bytes(np.zeros((2, 28, 28), dtype=np.uint8), 2051)
    )
    with pytest.raises(DatasetError, match="not its labels"):
        load_idx_dataset(tmp_path)


# -- digits -----------------------------------------------------------------------------
def test_digits_are_upsampled_by_blocks_and_padded():
    one = np.zeros((1, 8, 8), dtype=np.float32)
    one[0, 0, 0] = 1.0
    big = upsample_to_28(one)
    assert big.shape == (1, 28, 28)
    assert big[0, 2:5, 2:5].sum() == 9 and big.sum() == 9  # one 3x3 block inside a 2px border
    images, labels = load_digits_28()
    assert images.shape == (1797, 28, 28) and 0.0 <= images.min() and images.max() <= 1.0
    assert sorted(set(labels.tolist())) == list(range(10))


# -- 20 Newsgroups ----------------------------------------------------------------------
def _write_newsgroups(root: Path, with_test: bool = True) -> None:
    posts = {
        "rec.autos": ["engine and wheels", "brakes squeal"],
        "sci.space": ["orbit of the moon", "caf\xe9 on mars"],
        "comp.graphics": ["render a polygon"],
    }
    for split in ("train", "test") if with_test else ("train",):
        for category, bodies in posts.items():
            folder = root / f"20news-bydate-{split}" / category
            folder.mkdir(parents=True)
            # Numbered files: 9 must come before 10.
            for number, body in zip((10, 9), bodies, strict=False):
                message = f"From: a@b.c\nSubject: {category}\n\n{split} {body}\nbye\n"
                (folder / str(number)).write_bytes(message.encode("latin-1"))


def test_newsgroups_reader_reads_bydate_tree(tmp_path):
    _write_newsgroups(tmp_path)
    data = read_newsgroups(tmp_path)
    assert data.categories == ("comp.graphics", "rec.autos", "sci.space")
    assert data.train_labels == [0, 1, 1, 2, 2]
    assert data.train_texts[1] == "train brakes squeal\nbye\n"  # file 9 before 10
    assert data.train_texts[3] == "train caf\xe9 on mars\nbye\n"  # latin-1 decoded
    assert all("Subject:" not in t for t in data.train_texts + data.test_texts)
    assert len(data.test_texts) == 5 and data.test_texts[0].startswith("test ")


def test_newsgroups_reader_without_test_folder_and_errors(tmp_path):
    _write_newsgroups(tmp_path, with_test=False)
    assert read_newsgroups(tmp_path).test_texts == []
    with pytest.raises(DatasetError, match="20news-bydate-train"):
        read_newsgroups(tmp_path / "nowhere")
    assert strip_header("Subject: x\r\n\r\nbody\r\n\r\nmore") == "body\n\nmore"
    assert strip_header("no header at all") == "no header at all"


# -- AG News ----------------------------------------------------------------------------
def _write_ag_news(path: Path, n: int, header: bool = True) -> None:
    words = {1: "war", 2: "goal", 3: "stocks", 4: "software"}
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        if header:
            writer.writerow(["label", "title", "description"])
        for i in range(n):
            label = i % 4 + 1
            writer.writerow([label, f"{words[label]} title {i}", f"about {words[label]}, really"])


def test_ag_news_reader_reads_csv(tmp_path):
    path = tmp_path / "test.csv"
    _write_ag_news(path, 8)
    texts, labels = read_ag_news(path)
    assert labels == [0, 1, 2, 3, 0, 1, 2, 3]
    assert texts[2] == "stocks title 2 about stocks, really"
    headerless = tmp_path / "plain.csv"
    _write_ag_news(headerless, 4, header=False)
    assert read_ag_news(headerless)[1] == [0, 1, 2, 3]


def test_ag_news_reader_rejects_bad_rows(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("label,title,description\n5,t,d\n")
    with pytest.raises(DatasetError, match=r"bad.csv:2: label must be 1-4"):
        read_ag_news(path)
    path.write_text("label,title,description\n1,only two\n")
    with pytest.raises(DatasetError, match="expected 3 columns"):
        read_ag_news(path)


# -- text, corpus, splits -------------------------------------------------------------
def test_tokenizer_and_vocabulary_are_deterministic():
    assert tokenize("Don't STOP: 3 rockets, 2x!") == ["don't", "stop", "3", "rockets", "2x"]
    docs = [["b", "a", "c"], ["c", "a", "d"], ["b"]]
    vocab = Vocabulary.build(docs, max_size=5)
    # a, b and c appear twice each: ties go alphabetically; d is cut.
    assert vocab.tokens == ("<pad>", "<unk>", "a", "b", "c")
    np.testing.assert_array_equal(
        vocab.encode([["c", "d"], ["a", "b", "c", "a"]], max_len=3), [[4, 1, 0], [2, 3, 4]]
    )


def test_bundled_corpus_is_seeded_balanced_and_split_independent():
    texts, labels = topic_corpus(40, seed=3)
    assert (texts, labels) == topic_corpus(40, seed=3)
    assert topic_corpus(40, seed=4)[0] != texts
    assert all(5 <= labels.count(k) <= 15 for k in range(4))  # topics cycle; 5% label noise
    val_small = topic_corpus(20, seed=3, split="val")
    assert topic_corpus(30, seed=3, split="val")[0][:20] == val_small[0]
    assert val_small[0][:5] != texts[:5]


def test_pool_split_is_seeded_and_checks_sizes():
    train, val = pool_split(100, 30, 10, seed=1)
    assert len(train) == 30 and len(val) == 10 and not set(train) & set(val)
    again_train, again_val = pool_split(100, 50, 10, seed=1)
    assert list(again_val) == list(val)  # the validation part ignores train_samples
    default_train, default_val = pool_split(100, None, None, seed=1)
    assert (len(default_train), len(default_val)) == (80, 20)
    with pytest.raises(SpecError, match="needs more than the 100 examples") as info:
        pool_split(100, 95, 10, seed=1, field="workload.params.train_samples")
    assert info.value.field == "workload.params.train_samples"


# -- real data (skipped when /work/shared/datasets is absent) ------------------------------
def test_real_mnist_t10k_reads(shared_datasets):
    data = load_idx_dataset(shared_datasets / "mnist")
    assert data.train_images is None
    assert data.test_images.shape == (10000, 28, 28)
    assert sorted(set(data.test_labels.tolist())) == list(range(10))


def test_real_ag_news_reads(shared_datasets):
    texts, labels = read_ag_news(shared_datasets / "ag_news" / "test.csv")
    assert len(texts) == 7600
    assert [labels.count(k) for k in range(4)] == [1900] * 4
