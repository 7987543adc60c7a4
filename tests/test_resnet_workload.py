"""The built-in ``resnet`` workload: a small residual CNN with batch norm, trained for
real at tiny scale on the bundled digits and on IDX files the tests write."""

from __future__ import annotations

import gzip
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from pipetune.errors import SpecError, WorkloadError, WorkloadParamError
from pipetune.system import SystemConfig, applied_system_config
from pipetune.workloads import BUILTIN_WORKLOADS, resolve_workload
from pipetune.workloads.resnet import BasicBlock, ResNetWorkload, build_resnet

REPO = Path(__file__).resolve().parents[1]
CPU = SystemConfig()
#: Small enough for a fraction of a second per epoch on one thread.
TINY = {"train_samples": 256, "val_samples": 100, "width": 8, "blocks": 1}


@pytest.fixture(autouse=True)
def one_thread():
    """Train as an epoch task does: threads set from the system config (one core)."""
    with applied_system_config(CPU):
        yield


def _write_idx(path: Path, array: np.ndarray, magic: int) -> None:
    payload = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(gzip.compress(payload + array.astype(np.uint8).tobytes()))


def _write_pair(folder: Path, prefix: str, n: int, rng: np.random.Generator, side: int = 28):
    _write_idx(folder / f"{prefix}-images-idx3-ubyte.gz",
               rng.integers(0, 256, (n, side, side)), 2051)
    _write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10, 2049)


# -- the model ------------------------------------------------------------------------------
def test_model_has_two_stages_of_identity_blocks_and_one_downsampling():
    model = build_resnet(10, width=8, blocks=2)
    blocks = [m for m in model.modules() if isinstance(m, BasicBlock)]
    assert [b.conv1.in_channels for b in blocks] == [8, 8, 16, 16]
    assert all(b.conv2.out_channels == b.conv1.in_channels for b in blocks)  # identity skips
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 4 * 2 + 2
    assert [c.stride for c in convs].count((2, 2)) == 1
    assert all(c.bias is None for c in convs)  # each feeds a batch norm
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == len(convs)
    sizes = []
    hooks = [b.register_forward_hook(lambda _m, _i, out: sizes.append(tuple(out.shape[1:])))
             for b in blocks]
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    for hook in hooks:
        hook.remove()
    assert sizes == [(8, 28, 28), (8, 28, 28), (16, 14, 14), (16, 14, 14)]


def test_defaults_and_registration():
    assert BUILTIN_WORKLOADS["resnet"] == "pipetune.workloads.resnet:ResNetWorkload"
    assert resolve_workload("resnet") is ResNetWorkload
    assert ResNetWorkload.name == "resnet"
    workload = ResNetWorkload(train_samples=50, val_samples=20)
    assert (workload.settings["width"], workload.settings["blocks"]) == (24, 2)
    assert workload.settings["dataset"] == "digits"
    workload.setup({}, seed=0)
    assert workload.hparams == {"lr": 0.05, "batch_size": 64, "momentum": 0.9,
                                "weight_decay": 0.0}
    workload.setup({"weight_decay": 1e-4, "momentum": 0.0, "lr": 0.1}, seed=0)
    group = workload._optimizer.param_groups[0]
    assert isinstance(workload._optimizer, torch.optim.SGD)
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.1, 0.0, 1e-4)


# -- training -------------------------------------------------------------------------------
def test_training_lowers_loss_and_beats_chance():
    # Eval-mode batch norm (running statistics) lags behind the weights early in training,
    # so at this scale validation accuracy varies a lot with the seed: after 3 epochs it
    # was 0.32-0.48 over seeds 0-7 (10 classes, chance 0.1), the training loss falling
    # from 2.2-2.3 to 1.6-1.7 every time. Hence 768 images and a bound of twice chance.
    params = {**TINY, "train_samples": 768, "val_samples": 200}
    workload = ResNetWorkload(**params)
    workload.setup({"lr": 0.01, "batch_size": 16}, seed=0)
    stats = [workload.train_epoch(CPU) for _ in range(3)]
    assert stats[0].loss > stats[1].loss > stats[2].loss
    assert stats[0].samples == 768 and stats[0].steps == math.ceil(768 / 16)
    metrics = workload.evaluate(CPU)
    assert set(ResNetWorkload.metrics) <= set(metrics)
    assert metrics["accuracy"] > 0.2
    assert 0.0 < metrics["val_loss"] < 2.3
    logits = workload.predict()
    assert logits.shape == (200, 10) and logits.dtype == torch.float32
    assert workload.epoch == 3


def test_checkpoint_round_trip_continues_identically(tmp_path):
    params = {**TINY, "blocks": 2}
    hparams = {"lr": 0.05, "batch_size": 32, "weight_decay": 1e-4}
    workload = ResNetWorkload(**params)
    workload.setup(hparams, seed=3)
    workload.train_epoch(CPU)
    path = tmp_path / "epoch1.pt"
    workload.save(path)
    state = torch.load(path, weights_only=True)
    assert state["epoch"] == 1
    keys = list(state["model"])
    assert any(k.endswith("running_mean") for k in keys)  # batch-norm statistics travel
    assert not any(k.startswith("_orig_mod.") for k in keys)

    restored = ResNetWorkload(**params)
    restored.setup(hparams, seed=3)
    restored.load(path)
    assert restored.epoch == 1
    assert torch.equal(restored.predict(), workload.predict())
    # Momentum buffers, batch-norm statistics, epoch counter (shuffle order) all came back.
    assert restored.train_epoch(CPU).loss == workload.train_epoch(CPU).loss
    assert torch.equal(restored.predict(), workload.predict())
    assert restored.evaluate(CPU) == workload.evaluate(CPU)


def test_checkpoint_of_another_width_is_refused(tmp_path):
    narrow = ResNetWorkload(**TINY)
    narrow.setup({}, seed=0)
    narrow.save(tmp_path / "narrow.pt")
    wide = ResNetWorkload(**{**TINY, "width": 16})
    wide.setup({}, seed=0)
    with pytest.raises(WorkloadError, match="does not fit workload 'resnet'"):
        wide.load(tmp_path / "narrow.pt")


def test_channels_last_trains_like_contiguous():
    runs = {}
    for channels_last in (False, True):
        workload = ResNetWorkload(**{**TINY, "train_samples": 128})
        workload.setup({"batch_size": 32}, seed=1)
        config = SystemConfig(channels_last=channels_last)
        runs[channels_last] = (workload.train_epoch(config).loss,
                               workload.evaluate(config)["val_loss"])
    assert runs[True] == pytest.approx(runs[False], rel=1e-3)


# -- params and hyperparameters -------------------------------------------------------------
@pytest.mark.parametrize(
    ("params", "field", "text"),
    [
        ({"width": 0}, "width", r"integer in \[1, 512\], got 0"),
        ({"width": 513}, "width", "got 513"),
        ({"width": 8.0}, "width", "integer"),
        ({"width": True}, "width", "integer"),
        ({"blocks": 0}, "blocks", r"integer in \[1, 16\], got 0"),
        ({"blocks": 17}, "blocks", "got 17"),
        ({"blocks": "2"}, "blocks", "got '2'"),
        ({"dataset": "idx"}, "data_dir", "required when dataset is idx"),
        ({"data_dir": "/tmp"}, "data_dir", "only with dataset: idx"),
    ],
)
def test_bad_params_are_refused_naming_the_field(params, field, text):
    with pytest.raises(WorkloadParamError, match=text) as info:
        ResNetWorkload(**params)
    assert info.value.field == f"workload.params.{field}"
    assert info.value.param == field
    assert str(info.value).startswith(f"workload.params.{field}: ")


@pytest.mark.parametrize(
    ("params", "field", "text"),
    [
        ({"dataset": "cifar"}, "workload.params.dataset", "digits, idx"),
        ({"train_samples": 0}, "workload.params.train_samples", ">= 1"),
        ({"depth": 3}, "workload.params.depth", "allowed: dataset"),
    ],
)
def test_bad_data_params_name_the_field(params, field, text):
    with pytest.raises(SpecError, match=text) as info:
        ResNetWorkload(**params)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("hparams", "field", "text"),
    [
        ({"lr": 0.0}, "hyperparameters.lr", "must be > 0"),
        ({"momentum": 1.0}, "hyperparameters.momentum", "< 1"),
        ({"momentum": -0.1}, "hyperparameters.momentum", ">= 0"),
        ({"weight_decay": -1e-4}, "hyperparameters.weight_decay", ">= 0"),
        ({"batch_size": 2.5}, "hyperparameters.batch_size", "integer"),
        ({"width": 8}, "hyperparameters.width", "allowed: lr, batch_size, momentum, weight_decay"),
    ],
)
def test_bad_hyperparameters_name_the_field(hparams, field, text):
    workload = ResNetWorkload(train_samples=50, val_samples=20)
    with pytest.raises(SpecError, match=text) as info:
        workload.setup(hparams, seed=0)
    assert info.value.field == field


def test_a_job_file_refuses_a_bad_param_at_validation():
    from pipetune.spec import JobSpec
    from pipetune.system.config import MachineInfo

    job = {
        "name": "tiny-resnet",
        "workload": {"name": "resnet", "params": {"train_samples": 100, "width": 8}},
        "hyperparameters": {"lr": {"type": "loguniform", "low": 0.01, "high": 0.2},
                            "weight_decay": {"type": "uniform", "low": 0.0, "high": 1e-3}},
        "search": {"trials": 2},
        "early_stopping": {"max_epochs": 2},
    }
    machine = MachineInfo(cores=2, cuda_devices=0)
    assert JobSpec.from_dict(job, machine=machine).workload.name == "resnet"
    job["workload"]["params"]["blocks"] = -1
    with pytest.raises(SpecError) as info:
        JobSpec.from_dict(job, machine=machine)
    assert info.value.field == "workload.params.blocks"


# -- IDX files the test writes ----------------------------------------------------------------
def test_reads_idx_train_and_test_pairs(tmp_path):
    rng = np.random.default_rng(0)
    _write_pair(tmp_path, "train", 40, rng)
    _write_pair(tmp_path, "t10k", 24, rng)
    workload = ResNetWorkload(dataset="idx", data_dir=str(tmp_path), val_samples=16, width=8,
                              blocks=1)
    data = workload.data
    assert data.train_x.shape == (40, 1, 28, 28) and data.val_x.shape == (16, 1, 28, 28)
    assert data.train_x.dtype == torch.float32 and data.num_classes == 10
    assert abs(float(data.train_x.mean())) < 1e-4  # standardised by the training split
    workload.setup({"batch_size": 8}, seed=0)
    stats = workload.train_epoch(CPU)
    assert (stats.samples, stats.steps) == (40, 5) and math.isfinite(stats.loss)
    assert 0.0 <= workload.evaluate(CPU)["accuracy"] <= 1.0


def test_reads_a_lone_t10k_pair_as_a_seeded_split(tmp_path):
    # The shared MNIST folder holds only the t10k pair: it is split into train and val.
    _write_pair(tmp_path, "t10k", 60, np.random.default_rng(1))
    params = {"dataset": "idx", "data_dir": str(tmp_path), "train_samples": 30,
              "val_samples": 12, "width": 8, "blocks": 1}
    data = ResNetWorkload(**params).data
    assert data.train_x.shape == (30, 1, 28, 28) and data.val_x.shape == (12, 1, 28, 28)
    again = ResNetWorkload(**params).data
    assert torch.equal(again.train_y, data.train_y)
    with pytest.raises(SpecError) as info:
        ResNetWorkload(**{**params, "train_samples": 55}).setup({}, seed=0)
    assert info.value.field == "workload.params.train_samples"


def test_idx_images_of_another_size_are_refused(tmp_path):
    _write_pair(tmp_path, "t10k", 20, np.random.default_rng(2), side=32)
    workload = ResNetWorkload(dataset="idx", data_dir=str(tmp_path))
    with pytest.raises(WorkloadError, match="28x28"):
        workload.setup({}, seed=0)


# -- the bench job ------------------------------------------------------------------------------
def test_bench_job_loads_with_and_without_mnist(tmp_path):
    from pipetune.bench.jobs import load_bench_job

    path = REPO / "benchmarks" / "jobs" / "resnet_mnist.yaml"
    for datasets in (None, tmp_path / "absent"):
        job = load_bench_job(path, datasets=datasets)
        spec = job.spec
        assert spec.workload.name == "resnet"
        assert spec.search.trials == 8 and spec.early_stopping.max_epochs == 9
        assert spec.system.space == {"compile": [True], "channels_last": [True]}
    assert job.spec.workload.params["dataset"] == "digits" and "fallback" in job.data
