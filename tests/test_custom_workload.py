"""Your own model: the function API (TorchWorkload / torch_workload), the class API
(TorchClassifierWorkload) and the example in examples/custom_workload/, trained for
real at tiny scale."""

from __future__ import annotations

import importlib
import math
import os
import pickle
from pathlib import Path

import cloudpickle
import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import Dataset

from pipetune.checkpoints import CheckpointStore
from pipetune.engine.study import Study, run_study_locally
from pipetune.errors import SpecError, WorkloadError
from pipetune.spec import JobSpec
from pipetune.system import SystemConfig, applied_system_config
from pipetune.system.apply import applied_context
from pipetune.system.config import MachineInfo
from pipetune.workloads import HParam, TorchWorkload, Workload, resolve_workload, torch_workload

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_workload"
MACHINE = MachineInfo(cores=2)
CPU = SystemConfig()
#: Wine, no dropout: training after a restore must match training straight through.
HPARAMS = {"lr": 0.01, "batch_size": 16, "hidden": 16, "dropout": 0.0}


@pytest.fixture
def one_thread():
    """Train as an epoch task does: threads set from the system config (one core)."""
    with applied_system_config(CPU):
        yield


@pytest.fixture
def example(monkeypatch):
    """The example folder importable, as it is when a job file there is run."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    return EXAMPLE


@pytest.fixture
def wine(example):
    return importlib.import_module("wine_mlp").workload


def _job(name: str = "job.yaml", **changes) -> dict:
    job = yaml.safe_load((EXAMPLE / name).read_text())
    for section, values in changes.items():
        job[section] = {**job[section], **values} if isinstance(values, dict) else values
    return job


# -- module-level pieces of the test workloads (the function API needs module level) ------
def blob_splits(params: dict) -> tuple:
    """Three seeded Gaussian blobs in 4 dimensions; ``params["log"]``, when set, is a file
    that the training Dataset appends the reading process's pid to."""
    g = torch.Generator().manual_seed(params["seed"])
    centres = torch.randn(3, 4, generator=g) * 2.0
    y = torch.arange(params["n"]) % 3
    x = centres[y] + torch.randn(params["n"], 4, generator=g)
    cut = params["n"] * 3 // 4
    train = (x[:cut], y[:cut])
    if params["log"]:
        train = PidLoggingDataset(*train, log=params["log"])
    return train, (x[cut:], y[cut:])


class PidLoggingDataset(Dataset):
    """(x, y) rows that note which process read them."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, log: str):
        self.x, self.y, self.log = x, y, log

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return self.x[i], self.y[i]


def small_mlp(hparams: dict) -> nn.Module:
    return nn.Sequential(nn.Linear(4, hparams["hidden"]), nn.ReLU(),
                         nn.Linear(hparams["hidden"], 3))


blobs = torch_workload(model=small_mlp, data=blob_splits,
                       hparams={"lr": HParam(0.1), "hidden": HParam(8, int)},
                       params={"n": 200, "seed": 0, "log": ""})


def linear(hparams: dict) -> nn.Module:
    return nn.Linear(4, 3)  # torch's own initialisation, from torch's global RNG


def pretrained(hparams: dict) -> nn.Module:
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(0.5)  # as if loaded from a file
    return model


BLOB_PARAMS = {"n": 200, "seed": 0, "log": ""}
own_init = torch_workload(model=linear, data=blob_splits, params=BLOB_PARAMS, init_weights=False)
kept_pretrained = torch_workload(model=pretrained, data=blob_splits, params=BLOB_PARAMS,
                                 init_weights=False)
reinit_pretrained = torch_workload(model=pretrained, data=blob_splits, params=BLOB_PARAMS)


def no_splits(params: dict) -> list:
    return [1, 2, 3]


def regression_splits(params: dict) -> tuple:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(160, 3, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.1 * torch.randn(160, 1, generator=g)
    return (x[:120], y[:120]), (x[120:], y[120:])


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs - targets) ** 2).mean()


def mae(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs - targets).abs().mean()


def adam(parameters: list, hparams: dict) -> torch.optim.Optimizer:
    return torch.optim.Adam(parameters, lr=hparams["lr"])


@torch_workload(data=regression_splits, optimizer=adam, loss=mse, metrics={"mae": mae},
                hparams={"lr": 0.05, "optimiser": "adam"})
def linear_regression(hparams: dict) -> nn.Module:
    assert hparams["optimiser"] == "adam"
    return nn.Linear(3, 1)


# -- the function API ----------------------------------------------------------------------
def test_function_workload_trains_and_evaluates(wine, one_thread):
    workload = wine()
    assert isinstance(workload, Workload) and workload.name == "wine-mlp"
    workload.setup({"lr": 0.005, "batch_size": 16}, seed=0)
    assert workload.hparams == {"lr": 0.005, "batch_size": 16, "hidden": 32, "dropout": 0.1,
                                "weight_decay": 0.0}
    steps = []
    stats = [workload.train_epoch(CPU, on_step=lambda: steps.append(1)) for _ in range(3)]
    assert stats[0].loss > stats[1].loss > stats[2].loss, stats
    assert stats[0].samples == 134 and stats[0].steps == 9 and len(steps) == 27
    metrics = workload.evaluate(CPU)
    assert list(metrics) == list(wine.metrics) == ["accuracy", "val_loss"]
    assert metrics["accuracy"] > 0.8 and metrics["val_loss"] < math.log(3)
    assert workload.epoch == 3
    assert workload.predict().shape == (44, 3)


def test_checkpoint_round_trip_restores_metrics_and_training(wine, one_thread, tmp_path):
    first = wine()
    first.setup(HPARAMS, seed=5)
    for _ in range(2):
        first.train_epoch(CPU)
    first.save(tmp_path / "epoch-2.pt")

    second = wine()
    second.setup(HPARAMS, seed=5)
    second.load(tmp_path / "epoch-2.pt")
    assert second.epoch == 2
    assert second.evaluate(CPU) == first.evaluate(CPU)
    assert torch.equal(second.predict(), first.predict())
    # Optimiser state, epoch and seed came back too: the next epoch is the same epoch.
    assert second.train_epoch(CPU).loss == first.train_epoch(CPU).loss

    other = wine()
    other.setup({**HPARAMS, "hidden": 8}, seed=5)
    with pytest.raises(WorkloadError, match="does not fit"):
        other.load(tmp_path / "epoch-2.pt")


def test_system_config_reaches_the_data_loader(tmp_path, one_thread):
    """dataloader_workers from the AppliedConfig: rows are read in a worker process, and
    the batches (so the losses) do not depend on it."""
    losses, readers = {}, {}
    for workers in (0, 1):
        log = tmp_path / f"workers-{workers}.log"
        workload = blobs(log=str(log))
        workload.setup({"batch_size": 25}, seed=1)
        applied = applied_context(CPU.replace(dataloader_workers=workers))
        losses[workers] = [workload.train_epoch(applied).loss for _ in range(2)]
        readers[workers] = set(log.read_text().split())
    assert readers[0] == {str(os.getpid())}
    assert readers[1] and str(os.getpid()) not in readers[1]
    assert losses[0] == losses[1]


def test_custom_loss_metrics_and_the_decorator(one_thread):
    assert resolve_workload(f"{__name__}:linear_regression") is linear_regression
    assert linear_regression.metrics == ("mae", "val_loss")
    workload = linear_regression()
    workload.setup({}, seed=0)
    before = workload.evaluate(CPU)
    for _ in range(3):
        workload.train_epoch(CPU)
    after = workload.evaluate(CPU)
    assert after["val_loss"] < before["val_loss"] / 2 and after["mae"] < before["mae"]
    with pytest.raises(SpecError, match="must be a str") as info:
        workload.setup({"optimiser": 3}, seed=0)
    assert info.value.field == "hyperparameters.optimiser"


def test_init_weights_false_keeps_the_factorys_weights():
    def weights(cls, seed):
        workload = cls()
        workload.setup({}, seed=seed)
        return workload.state_dict()["model"]["weight"]

    rng_before = torch.get_rng_state()
    kept = weights(own_init, 7)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the global RNG is left alone
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        assert torch.equal(kept, nn.Linear(4, 3).weight.detach())  # the factory's, seeded
    assert torch.equal(weights(own_init, 7), kept)
    assert not torch.equal(weights(own_init, 8), kept)
    assert bool((weights(kept_pretrained, 0) == 0.5).all())
    assert not bool((weights(reinit_pretrained, 0) == 0.5).any())  # pipetune's own init


def test_workload_pickles_by_reference(wine, one_thread):
    workload = wine()
    workload.setup(HPARAMS, seed=0)
    workload.train_epoch(CPU)
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)):
        clone = loads(dumps(workload))
        assert type(clone) is wine  # found again by module and name, not copied
        assert torch.equal(clone.predict(), workload.predict())
    assert pickle.loads(pickle.dumps(wine)) is wine


def test_bad_params_hyperparameters_and_data_name_the_problem(wine):
    with pytest.raises(SpecError) as info:
        wine(val_fraction=0.9)
    assert info.value.field == "workload.params.val_fraction"
    with pytest.raises(SpecError, match="allowed: val_fraction, data_seed") as info:
        wine(colour="red")
    assert info.value.field == "workload.params.colour"
    workload = wine()
    with pytest.raises(SpecError, match="must be > 0") as info:
        workload.setup({"hidden": 0}, seed=0)
    assert info.value.field == "hyperparameters.hidden"
    with pytest.raises(SpecError, match="not a hyperparameter") as info:
        workload.setup({"width": 3}, seed=0)
    assert info.value.field == "hyperparameters.width"
    with pytest.raises(TypeError, match="model must be a function"):
        TorchWorkload(model=3, data=blob_splits)
    broken = torch_workload(model=small_mlp, data=no_splits, hparams={"hidden": 4})
    with pytest.raises(WorkloadError, match=r"data\(\) must return \(train, val\)"):
        broken().setup({}, seed=0)


# -- job files -------------------------------------------------------------------------------
def test_example_jobs_validate(example):
    spec = JobSpec.from_dict(_job(), machine=MACHINE)
    assert spec.workload.name == "wine_mlp:workload"
    assert spec.objective.metric == "val_loss"
    job = _job()
    job["hyperparameters"]["width"] = {"type": "choice", "values": [8]}
    with pytest.raises(SpecError, match="allowed: lr, batch_size, hidden") as info:
        JobSpec.from_dict(job, machine=MACHINE)
    assert info.value.field == "hyperparameters.width"
    job = _job()
    job["hyperparameters"]["dropout"] = {"type": "uniform", "low": 0.0, "high": 1.5}
    with pytest.raises(SpecError, match="< 1") as info:
        JobSpec.from_dict(job, machine=MACHINE)
    assert info.value.field == "hyperparameters.dropout"

    classy = JobSpec.from_dict(_job("digits_job.yaml"), machine=MACHINE)
    workload = classy.workload.build()
    with applied_system_config(CPU):
        workload.setup({"lr": 0.1}, seed=0)
        workload.train_epoch(CPU)
        assert workload.evaluate(CPU)["accuracy"] > 0.8


def test_example_job_runs_end_to_end(example, tmp_path):
    """The example job through the engine, in this process: 2 trials x 2 epochs, epoch 2
    a probe of another system config."""
    job = _job(search={"trials": 2, "max_concurrent": 1},
               early_stopping={"policy": "none", "max_epochs": 2})
    study = Study(JobSpec.from_dict(job, machine=MACHINE), study_id="custom",
                  checkpoints=CheckpointStore(tmp_path / "ck"), core_budget=2, machine=MACHINE)
    run_study_locally(study)
    assert study.done and len(study.trials) == 2
    for trial in study.trials.values():
        assert [r.epoch for r in trial.results] == [1, 2], trial
        assert trial.results[0].system == SystemConfig(cores=1, interop_threads=1)
        assert trial.probe_epochs == 1
    best = study.best_trial()
    assert best is not None
    value = best.last_value("val_loss")
    assert value == min(t.last_value("val_loss") for t in study.trials.values())
    assert 0 < value < math.log(3)  # better than chance on 3 classes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_training_and_cpu_restore(wine, tmp_path, precision):
    system = SystemConfig(device="cuda", precision=precision)
    with applied_system_config(system) as applied:
        workload = wine()
        workload.setup(HPARAMS, seed=0)
        losses = [workload.train_epoch(applied).loss for _ in range(3)]
        metrics = workload.evaluate(applied)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert metrics["accuracy"] > 0.8
    workload.save(tmp_path / "gpu.pt")
    on_cpu = wine()
    on_cpu.setup(HPARAMS, seed=0)
    on_cpu.load(tmp_path / "gpu.pt")
    torch.testing.assert_close(on_cpu.predict(), workload.predict(), atol=5e-2, rtol=1e-2)
    on_cpu.train_epoch(CPU)  # optimiser state moved back to the CPU with the model
