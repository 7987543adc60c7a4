"""Built-in workloads train for real at tiny scale; resolve_workload finds user workloads."""

from __future__ import annotations

import math
import multiprocessing
import subprocess
import sys
import textwrap
import time

import cloudpickle
import numpy as np
import pytest
import torch

from pipetune.errors import SpecError, WorkloadError
from pipetune.system import SystemConfig, applied_system_config
from pipetune.workloads import BUILTIN_WORKLOADS, Workload, resolve_workload
from pipetune.workloads.lenet import LeNet5Workload
from pipetune.workloads.synthetic import SyntheticWorkload
from pipetune.workloads.textcnn import TextCNNWorkload

CPU = SystemConfig()
CPU_WORKER = CPU.replace(dataloader_workers=1)

LENET = (LeNet5Workload, {"train_samples": 500, "val_samples": 200}, {"lr": 0.02, "batch_size": 16})
TEXT = (TextCNNWorkload, {"train_samples": 400, "val_samples": 200}, {"lr": 3e-3, "batch_size": 32})
#: Smaller sets for the tests that compare runs rather than accuracy.
SMALL = {"train_samples": 160, "val_samples": 64}
BOTH = [
    pytest.param(LENET[0], SMALL, LENET[2], id="lenet5-digits"),
    pytest.param(TEXT[0], SMALL, TEXT[2], id="textcnn-bundled"),
]


@pytest.fixture(autouse=True)
def one_thread():
    """Train as an epoch task does: threads set from the system config (one core)."""
    with applied_system_config(CPU):
        yield


def _trained(cls, params, hparams, epochs, seed=0, system=CPU):
    workload = cls(**params)
    workload.setup(hparams, seed)
    losses = [workload.train_epoch(system).loss for _ in range(epochs)]
    return workload, losses


# -- training -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cls", "params", "hparams", "epochs", "floor"),
    [pytest.param(*LENET, 4, 0.5, id="lenet5-digits"), pytest.param(*TEXT, 3, 0.4, id="textcnn")],
)
def test_training_lowers_loss_and_beats_chance(cls, params, hparams, epochs, floor):
    workload = cls(**params)
    workload.setup(hparams, seed=0)
    steps_seen = []
    stats = [workload.train_epoch(CPU, on_step=lambda: steps_seen.append(1)) for _ in range(epochs)]
    assert stats[2].loss < stats[0].loss
    batch = hparams["batch_size"]
    assert stats[0].samples == params["train_samples"]
    assert stats[0].steps == math.ceil(params["train_samples"] / batch)
    assert len(steps_seen) == sum(s.steps for s in stats)
    metrics = workload.evaluate(CPU)
    assert set(cls.metrics) <= set(metrics)
    assert metrics["accuracy"] > floor
    assert 0.0 < metrics["val_loss"] < 2.0
    logits = workload.predict()
    assert logits.shape == (params["val_samples"], workload.data.num_classes)
    assert logits.dtype == torch.float32 and workload.epoch == epochs


@pytest.mark.parametrize(("cls", "params", "hparams"), BOTH)
def test_checkpoint_round_trip_restores_predictions_and_training(tmp_path, cls, params, hparams):
    workload, _ = _trained(cls, params, hparams, epochs=1)
    path = tmp_path / "epoch1.pt"
    workload.save(path)
    state = torch.load(path, weights_only=True)
    assert state["epoch"] == 1

    restored = cls(**params)
    restored.setup(hparams, seed=0)
    restored.load(path)
    assert restored.epoch == 1
    assert torch.equal(restored.predict(), workload.predict())
    # Optimiser, epoch counter (shuffle order) and dropout RNG all came back: the next
    # epoch is the same as the uninterrupted run's.
    assert restored.train_epoch(CPU).loss == workload.train_epoch(CPU).loss
    assert torch.equal(restored.predict(), workload.predict())


@pytest.mark.parametrize(("cls", "params", "hparams"), BOTH)
def test_training_is_reproducible_under_a_seed(cls, params, hparams):
    _, first = _trained(cls, params, hparams, epochs=2, seed=7)
    _, second = _trained(cls, params, hparams, epochs=2, seed=7)
    _, other = _trained(cls, params, hparams, epochs=2, seed=8)
    assert first == second
    assert other != first


@pytest.mark.parametrize(("cls", "params", "hparams"), BOTH)
def test_loader_workers_keep_training_reproducible(cls, params, hparams):
    _, first = _trained(cls, params, hparams, epochs=2, seed=3, system=CPU_WORKER)
    _, second = _trained(cls, params, hparams, epochs=2, seed=3, system=CPU_WORKER)
    _, in_process = _trained(cls, params, hparams, epochs=2, seed=3, system=CPU)
    assert first == second
    assert first == in_process  # the batch order does not depend on the worker count


def _train_in_daemon(conn):
    try:
        workload = SyntheticWorkload(train_samples=32)
        workload.setup({}, seed=0)
        workload.train_epoch(CPU_WORKER)
        conn.send("trained")
    except WorkloadError as exc:
        conn.send(str(exc))


def test_loader_workers_in_a_daemonic_process_fail_clearly():
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_train_in_daemon, args=(child,), daemon=True)
    process.start()
    message = parent.recv()
    process.join()
    assert "distributed.worker.daemon" in message


@pytest.mark.parametrize(("cls", "params", "hparams"), BOTH)
def test_workload_survives_cloudpickle(cls, params, hparams):
    fresh = cloudpickle.loads(cloudpickle.dumps(cls(**params)))
    assert fresh.params == params
    workload, _ = _trained(cls, params, hparams, epochs=1)
    clone = cloudpickle.loads(cloudpickle.dumps(workload))
    assert torch.equal(clone.predict(), workload.predict())
    assert clone.train_epoch(CPU).loss == workload.train_epoch(CPU).loss


# -- params and hyperparameters -------------------------------------------------------------
@pytest.mark.parametrize(
    ("cls", "params", "field", "text"),
    [
        (LeNet5Workload, {"colour": "red"}, "workload.params.colour", "allowed: dataset"),
        (LeNet5Workload, {"dataset": "cifar"}, "workload.params.dataset", "digits, idx"),
        (LeNet5Workload, {"dataset": "idx"}, "workload.params.data_dir", "required"),
        (LeNet5Workload, {"train_samples": 0}, "workload.params.train_samples", ">= 1"),
        (TextCNNWorkload, {"dataset": "ag_news"}, "workload.params.path", "exactly one"),
        (TextCNNWorkload, {"max_len": 4}, "workload.params.max_len", ">= 5"),
        (TextCNNWorkload, {"dataset": "20newsgroups"}, "workload.params.data_dir", "required"),
        (
            SyntheticWorkload,
            {"cost_by_knob": {"turbo": {1: 1}}},
            "workload.params.cost_by_knob.turbo",
            "unknown knob",
        ),
        (
            SyntheticWorkload,
            {"cost_by_knob": {"cores": {1: -1}}},
            "workload.params.cost_by_knob.cores.1",
            ">= 0",
        ),
        (SyntheticWorkload, {"base_seconds": "1"}, "workload.params.base_seconds", "number"),
    ],
)
def test_bad_params_name_the_field(cls, params, field, text):
    with pytest.raises(SpecError, match=text) as info:
        cls(**params)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("hparams", "field", "text"),
    [
        ({"lr": -0.1}, "hyperparameters.lr", "must be > 0"),
        ({"batch_size": 2.5}, "hyperparameters.batch_size", "integer"),
        ({"momentum": 1.0}, "hyperparameters.momentum", "< 1"),
        ({"width": 3}, "hyperparameters.width", "allowed: lr, batch_size, momentum"),
    ],
)
def test_bad_hyperparameters_name_the_field(hparams, field, text):
    workload = LeNet5Workload(train_samples=50, val_samples=20)
    with pytest.raises(SpecError, match=text) as info:
        workload.setup(hparams, seed=0)
    assert info.value.field == field


def test_defaults_fill_hyperparameters_and_sizes_are_checked():
    workload = LeNet5Workload(train_samples=50, val_samples=20)
    with pytest.raises(WorkloadError, match="after setup"):
        _ = workload.batch_size
    workload.setup({"batch_size": np.int64(32), "lr": 0.05}, seed=np.int64(0))
    assert workload.batch_size == 32 and type(workload.hparams["batch_size"]) is int
    assert workload.hparams == {"lr": 0.05, "batch_size": 32, "momentum": 0.9}
    with pytest.raises(SpecError, match="1797 examples"):
        LeNet5Workload(train_samples=5000).setup({}, seed=0)


def test_checkpoint_from_other_hyperparameters_is_rejected(tmp_path):
    small, _ = _trained(TextCNNWorkload, TEXT[1], {"embed_dim": 16}, epochs=0)
    small.save(tmp_path / "small.pt")
    big = TextCNNWorkload(**TEXT[1])
    big.setup({"embed_dim": 32}, seed=0)
    with pytest.raises(WorkloadError, match="does not fit workload 'textcnn'"):
        big.load(tmp_path / "small.pt")


# -- workloads on data files the test writes ------------------------------------------------
def _write_idx(path, array, magic):
    import gzip
    import struct

    payload = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(gzip.compress(payload + array.astype(np.uint8).tobytes()))


def test_lenet_reads_idx_train_and_test_pairs(tmp_path):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 40), ("t10k", 24)):
        _write_idx(
            tmp_path / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)), 2051
        )
        _write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10, 2049)
    workload = LeNet5Workload(dataset="idx", data_dir=str(tmp_path), val_samples=16)
    data = workload.data
    assert data.train_x.shape == (40, 1, 28, 28) and data.val_x.shape == (16, 1, 28, 28)
    assert abs(float(data.train_x.mean())) < 1e-4  # standardised by the training split
    workload.setup({"batch_size": 8}, seed=0)
    assert workload.train_epoch(CPU).samples == 40


def test_textcnn_reads_newsgroups_and_ag_news(tmp_path):
    for split in ("train", "test"):
        for category, word in (("rec.autos", "engine"), ("sci.space", "orbit")):
            folder = tmp_path / f"20news-bydate-{split}" / category
            folder.mkdir(parents=True)
            for i in range(6):
                (folder / str(i + 1)).write_text(f"From: x\n\n{word} number {i} {word}\n")
    news = TextCNNWorkload(dataset="20newsgroups", data_dir=str(tmp_path), max_len=8)
    assert news.data.num_classes == 2 and news.data.extra["classes"] == ("rec.autos", "sci.space")
    assert news.data.train_x.shape == (12, 8) and news.data.val_x.shape == (12, 8)
    news.setup({"batch_size": 4}, seed=0)
    assert news.train_epoch(CPU).steps == 3

    csv_path = tmp_path / "ag.csv"
    rows = ["label,title,description"]
    rows += [f'{i % 4 + 1},title {i},"words, and {i % 4} more"' for i in range(40)]
    csv_path.write_text("\n".join(rows) + "\n")
    ag = TextCNNWorkload(dataset="ag_news", path=str(csv_path), val_samples=10, data_seed=1)
    assert ag.data.num_classes == 4 and len(ag.data.train_y) == 30 and len(ag.data.val_y) == 10
    again = TextCNNWorkload(dataset="ag_news", path=str(csv_path), val_samples=10, data_seed=1)
    assert torch.equal(again.data.val_x, ag.data.val_x)


# -- synthetic ------------------------------------------------------------------------------
def test_synthetic_sleep_follows_the_documented_formula():
    workload = SyntheticWorkload(
        base_seconds=0.5,
        cost_by_knob={
            "cores": {"1": 0.3, 2: 0.1},
            "dataloader_workers": {1: 0.05},
            "channels_last": {True: 0.2},
        },
    )
    assert workload.sleep_seconds(SystemConfig(cores=1)) == pytest.approx(0.8)
    two_with_worker = SystemConfig(cores=2, dataloader_workers=1)
    assert workload.sleep_seconds(two_with_worker) == pytest.approx(0.65)
    assert workload.sleep_seconds(SystemConfig(cores=3)) == pytest.approx(0.5)
    cuda = SystemConfig(cores=1, device="cuda", channels_last=True)
    assert workload.sleep_seconds(cuda) == pytest.approx(1.0)


def test_synthetic_trains_for_real_and_sleeps():
    workload = SyntheticWorkload(base_seconds=0.1, train_samples=256)
    workload.setup({"lr": 0.05}, seed=0)
    started = time.monotonic()
    first = workload.train_epoch(CPU)
    assert time.monotonic() - started >= 0.099  # at least the planned sleep
    later = [workload.train_epoch(CPU).loss for _ in range(2)]
    assert later[-1] < first.loss
    assert workload.evaluate(CPU)["accuracy"] > 0.5


def test_synthetic_fails_at_its_epoch_even_after_a_restore(tmp_path):
    params = {"fail_at_epoch": 2, "train_samples": 64}
    workload = SyntheticWorkload(**params)
    workload.setup({}, seed=0)
    workload.train_epoch(CPU)
    workload.save(tmp_path / "e1.pt")

    elsewhere = cloudpickle.loads(cloudpickle.dumps(SyntheticWorkload(**params)))
    elsewhere.setup({}, seed=0)
    elsewhere.load(tmp_path / "e1.pt")
    with pytest.raises(RuntimeError, match="epoch 2"):
        elsewhere.train_epoch(CPU)
    with pytest.raises(RuntimeError, match="epoch 2"):
        workload.train_epoch(CPU)


# -- resolve_workload -------------------------------------------------------------------------
USER_MODULE = """
from pipetune.workloads import TrainStats, Workload


class ConstantWorkload(Workload):
    name = "constant"

    def setup(self, hparams, seed):
        self.hparams = dict(hparams)

    @property
    def batch_size(self):
        return 1

    def train_epoch(self, system, on_step=None):
        return TrainStats(loss=0.0, samples=1, steps=1)

    def evaluate(self, system):
        return {"accuracy": self.hparams["x"], "val_loss": 0.0}

    def predict(self):
        return None

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class HalfWorkload(Workload):
    name = "half"


NOT_A_CLASS = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "pipetune_test_user_workloads.py").write_text(textwrap.dedent(USER_MODULE))
    (tmp_path / "pipetune_test_broken.py").write_text("1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "pipetune_test_user_workloads"


def test_resolve_builtins():
    assert set(BUILTIN_WORKLOADS) == {"lenet5", "textcnn", "synthetic", "resnet"}
    for name in BUILTIN_WORKLOADS:
        cls = resolve_workload(name)
        assert issubclass(cls, Workload) and cls.name == name
    assert resolve_workload("lenet5") is LeNet5Workload


def test_resolve_user_workload_by_import_path(user_module):
    cls = resolve_workload(f"{user_module}:ConstantWorkload")
    workload = cls()
    workload.setup({"x": 0.25}, seed=0)
    assert workload.evaluate(CPU)["accuracy"] == 0.25


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("resnet9000", "unknown workload 'resnet9000'; built-ins: lenet5, textcnn, synthetic"),
        ("no_such_pkg.mod:Thing", "cannot import module 'no_such_pkg.mod': ModuleNotFoundError"),
        ("pipetune_test_broken:Thing", "cannot import module 'pipetune_test_broken': Zero"),
        ("{mod}:Missing", "has no attribute 'Missing'"),
        ("{mod}:NOT_A_CLASS", "is not a subclass of pipetune.workloads.Workload"),
        ("collections:OrderedDict", "is not a subclass of pipetune.workloads.Workload"),
        ("{mod}:HalfWorkload", "is abstract; it does not implement: batch_size, evaluate"),
        ("a:b:c", "package.module:Class"),
        ("", "built-in name"),
    ],
)
def test_resolve_errors_are_one_clear_line(user_module, name, text):
    with pytest.raises(WorkloadError) as info:
        resolve_workload(name.format(mod=user_module))
    assert text in str(info.value)
    assert "\n" not in str(info.value)


def test_importing_workloads_does_not_import_torch():
    code = (
        "import sys, pipetune.workloads as w; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "print(sorted(w.BUILTIN_WORKLOADS))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=".")
    assert done.returncode == 0, done.stderr
    assert "lenet5" in done.stdout


# -- real data (skipped when /work/shared/datasets is absent) ---------------------------------
def test_lenet_learns_real_mnist(shared_datasets):
    params = {"dataset": "idx", "data_dir": str(shared_datasets / "mnist")}
    workload, losses = _trained(
        LeNet5Workload,
        {**params, "train_samples": 800, "val_samples": 200},
        {"lr": 0.02, "batch_size": 16},
        epochs=3,
    )
    assert losses[-1] < losses[0]
    assert workload.evaluate(CPU)["accuracy"] > 0.5  # chance is 0.1


def test_textcnn_learns_real_ag_news(shared_datasets):
    params = {"dataset": "ag_news", "data_dir": str(shared_datasets / "ag_news")}
    workload, losses = _trained(
        TextCNNWorkload,
        {**params, "train_samples": 800, "val_samples": 200},
        {"lr": 3e-3, "batch_size": 32},
        epochs=4,
    )
    assert losses[-1] < losses[0]
    assert workload.evaluate(CPU)["accuracy"] > 0.4  # chance is 0.25


# -- CUDA (runs only where torch sees a GPU) ---------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize(
    ("cls", "params", "hparams", "system"),
    [
        pytest.param(
            *LENET,
            SystemConfig(device="cuda", precision="fp16", channels_last=True),
            id="lenet5-fp16-channels-last",
        ),
        pytest.param(
            *TEXT, SystemConfig(device="cuda", precision="bf16", tf32=True), id="textcnn-bf16"
        ),
    ],
)
def test_cuda_training_and_cpu_restore(tmp_path, cls, params, hparams, system):
    with applied_system_config(system):
        workload, losses = _trained(cls, params, hparams, epochs=3, system=system)
        metrics = workload.evaluate(system)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert metrics["accuracy"] > 0.3
    workload.save(tmp_path / "gpu.pt")
    on_cpu = cls(**params)
    on_cpu.setup(hparams, seed=0)
    on_cpu.load(tmp_path / "gpu.pt")
    # cuDNN may use TF32 convolutions, so CPU and GPU logits agree only loosely.
    torch.testing.assert_close(on_cpu.predict(), workload.predict(), atol=5e-2, rtol=1e-2)
    on_cpu.train_epoch(CPU)  # optimiser state moved back to the CPU with the model
