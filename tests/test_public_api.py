"""The public API holds (README "What is public"): a workload written against the
previous release, reading the system knobs off ``system`` as attributes as it did on
the ``SystemConfig`` it was given then, runs real studies to completion (through the
engine and through ``pipetune tune``) and reads exactly the knobs the study chose;
what ``AppliedConfig`` still answers for ``SystemConfig`` warns and answers right; a
job file of the previous release (commit 07a240c, README "Job files") stays valid."""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from pipetune.checkpoints import CheckpointStore
from pipetune.engine.study import Study, run_study_locally
from pipetune.errors import WorkloadError
from pipetune.spec import JobSpec, load_spec
from pipetune.states import TrialState
from pipetune.system import SystemConfig, applied_system_config
from pipetune.system.apply import AppliedConfig, Device, applied_context
from pipetune.system.config import KNOBS, MachineInfo

MACHINE = MachineInfo(cores=2)
PIPETUNE = [sys.executable, "-m", "pipetune"]

#: A workload as a user wrote one against the previous release's ``Workload``: it never
#: touches the helpers (``loader_options()``, ``memory_format``, ...), only the knobs, as
#: attributes of ``system``, and notes every knob it read (one JSON line per call).
OLD_STYLE_SOURCE = r'''
"""Written against the previous release: train_epoch(system) read knobs as attributes."""

import contextlib
import json
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pipetune.workloads import TrainStats, Workload

KNOBS = ("cores", "interop_threads", "dataloader_workers", "omp_wait_policy", "pin_cores",
         "device", "precision", "tf32", "cudnn_benchmark", "channels_last", "compile")


def blobs(n):
    g = torch.Generator().manual_seed(0)
    y = torch.arange(n) % 2
    x = torch.randn(n, 2, 4, 4, generator=g) + 1.5 * y.view(-1, 1, 1, 1).float()
    return x, y


def channels_last(t):
    """Laid out NHWC and not NCHW (2 channels: the two differ)."""
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


class OldStyleWorkload(Workload):
    name = "old-style"

    def __init__(self, log, samples=64):
        super().__init__(log=log, samples=samples)
        self.log = log
        self.samples = samples

    def setup(self, hparams, seed):
        torch.manual_seed(seed)
        self.seed = seed
        self.model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(),
                                   nn.Linear(16, 2))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=hparams["lr"])
        self.epoch = 0

    @property
    def batch_size(self):
        return 16

    def _note(self, call, system, **seen):
        row = {"call": call, "seed": self.seed, "epoch": self.epoch, "pid": os.getpid(),
               **{knob: getattr(system, knob) for knob in KNOBS}, **seen}
        row["device"] = str(row["device"])
        with open(self.log, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    def train_epoch(self, system, on_step=None):
        fmt = torch.channels_last if system.channels_last else torch.contiguous_format
        self.model.to(system.device)
        self.model.to(memory_format=fmt)
        x, y = blobs(self.samples)
        loader = DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=True,
                            num_workers=system.dataloader_workers,
                            generator=torch.Generator().manual_seed(self.seed + self.epoch))
        if system.precision == "bf16":
            cast = torch.autocast(device_type=system.device, dtype=torch.bfloat16)
        else:
            cast = contextlib.nullcontext()
        total = torch.zeros((), device=system.device)
        samples = steps = 0
        for xb, yb in loader:
            xb = xb.to(system.device).contiguous(memory_format=fmt)
            yb = yb.to(system.device)
            with cast:
                loss = nn.functional.cross_entropy(self.model(xb).float(), yb)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            total += loss.detach() * len(yb)
            samples += len(yb)
            steps += 1
            if on_step is not None:
                on_step()
        self.epoch += 1
        self._note("train_epoch", system, device_is_cpu=system.device == "cpu",
                   threads=torch.get_num_threads(), loader_workers=loader.num_workers,
                   input_channels_last=channels_last(xb),
                   weight_channels_last=channels_last(self.model[0].weight),
                   param_device=str(self.model[0].weight.device))
        return TrainStats(loss=float(total) / samples, samples=samples, steps=steps)

    def evaluate(self, system):
        x, y = blobs(self.samples)
        device = "cuda" if system.device == "cuda" else "cpu"
        self.model.eval()
        with torch.no_grad():
            logits = self.model(x.to(device)).float()
        self.model.train()
        y = y.to(device)
        self._note("evaluate", system, device_is_cpu=system.device == "cpu")
        return {"accuracy": float((logits.argmax(1) == y).float().mean()),
                "val_loss": float(nn.functional.cross_entropy(logits, y))}

    def state_dict(self):
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "epoch": self.epoch}

    def load_state_dict(self, state):
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.epoch = int(state["epoch"])
'''

#: The previous release's job file, as its README ("Job files") printed it.
PREVIOUS_RELEASE_JOB = """\
name: lenet-digits
workload:                     # built-in (lenet5, textcnn, synthetic) or package.module:Class
  name: lenet5
  params: {dataset: digits, train_samples: 1200, val_samples: 400}
hyperparameters:              # choice | uniform | loguniform | int (log: true|false)
  lr: {type: loguniform, low: 0.005, high: 0.2}
  batch_size: {type: choice, values: [32, 64, 128]}
system:
  default: {cores: 1, interop_threads: 1, dataloader_workers: 0}   # epoch 1 runs here
  space: {cores: [1, 2], dataloader_workers: [0, 1]}               # what probes may try
search: {algorithm: tpe, trials: 6, seed: 0, max_concurrent: 2}    # random | grid | tpe
early_stopping: {policy: asha, min_epochs: 1, max_epochs: 3, reduction_factor: 2}  # or none
objective: {metric: accuracy, mode: max, system: time}             # system: time | energy
pipetune:
  enabled: true
  probe_plan: one_knob        # change one knob at a time from the default (the paper's plan)
  similarity: {max_clusters: 8, bound_factor: 2.0, min_bound: 2.0}
profiler: {op_mix_steps: 10, watts_per_core: 10.0, perf: auto}
"""


@pytest.fixture
def old_style(tmp_path, monkeypatch):
    """The old-style workload as a module of its own beside a job file, importable."""
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "old_style_workload.py").write_text(OLD_STYLE_SOURCE)
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    sys.modules.pop("old_style_workload", None)


def old_style_job(log: Path, name: str = "old-style") -> dict:
    """Two trials of three epochs: epoch 1 under the default, epochs 2 and 3 probing
    dataloader_workers=1 and channels_last=True, one knob at a time."""
    return {
        "name": name,
        "workload": {"name": "old_style_workload:OldStyleWorkload",
                     "params": {"log": str(log), "samples": 64}},
        "hyperparameters": {"lr": {"type": "loguniform", "low": 0.01, "high": 0.1}},
        "system": {"default": {"cores": 1, "interop_threads": 1, "dataloader_workers": 0},
                   "space": {"dataloader_workers": [0, 1], "channels_last": [False, True]}},
        "search": {"algorithm": "random", "trials": 2, "seed": 0, "max_concurrent": 1},
        "early_stopping": {"policy": "none", "max_epochs": 3},
        "objective": {"metric": "accuracy", "mode": "max", "system": "time"},
    }


def read_log(log: Path) -> tuple[dict, dict]:
    """The knobs each (seed, epoch) read in train_epoch (once) and in evaluate (its
    evaluation after training, and the best model's again at the study's end)."""
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    train = {(r["seed"], r["epoch"]): r for r in rows if r["call"] == "train_epoch"}
    assert len(train) == sum(r["call"] == "train_epoch" for r in rows), "each epoch once"
    evaluate: dict = {}
    for row in rows:
        if row["call"] == "evaluate":
            evaluate.setdefault((row["seed"], row["epoch"]), []).append(row)
    return train, evaluate


def assert_read_as_chosen(row: dict, system: SystemConfig) -> None:
    """What the workload read off ``system`` is ``system``, knob by knob."""
    assert {knob: row[knob] for knob in KNOBS} == system.to_dict(), row
    assert row["device_is_cpu"] is True


def assert_honoured(row: dict, system: SystemConfig) -> None:
    """Using the knobs it read, the epoch really ran under ``system``."""
    assert row["threads"] == system.cores
    assert row["loader_workers"] == system.dataloader_workers
    assert row["input_channels_last"] is system.channels_last
    assert row["weight_channels_last"] is system.channels_last
    assert row["param_device"] == "cpu"


# -- a workload written the old way, through a real study ------------------------------------

def test_an_old_style_workload_runs_a_real_study_reading_the_knobs_the_study_chose(
    tmp_path, old_style
):
    log = tmp_path / "reads.jsonl"
    spec = JobSpec.from_dict(old_style_job(log), machine=MACHINE)
    study = Study(spec, study_id="old-style", checkpoints=CheckpointStore(tmp_path / "ck"),
                  core_budget=1, machine=MACHINE)
    run_study_locally(study)
    assert study.done and len(study.trials) == 2
    for trial in study.trials.values():
        assert trial.state is TrialState.COMPLETE, trial.error
        assert [r.epoch for r in trial.results] == [1, 2, 3]
    assert len({t.seed for t in study.trials.values()}) == 2
    chosen = {(t.seed, r.epoch): r.system for t in study.trials.values() for r in t.results}
    train, evaluate = read_log(log)
    assert set(train) == set(evaluate) == set(chosen)
    for key, system in chosen.items():
        assert_read_as_chosen(train[key], system)
        (row,) = evaluate[key]  # the engine alone evaluates each epoch once
        assert_read_as_chosen(row, system)
        assert_honoured(train[key], system)
    # The study chose other values than the defaults, so reading them was exercised.
    assert any(s.dataloader_workers == 1 for s in chosen.values())
    assert any(s.channels_last for s in chosen.values())
    assert any(s == SystemConfig() for s in chosen.values())


@pytest.mark.slow
def test_an_old_style_workload_runs_through_pipetune_tune(tmp_path, old_style):
    """The same workload beside its job file, run as a user runs it: ``pipetune tune``
    on the embedded cluster; MLflow's record of each epoch's knobs matches what the
    workload read in its Dask worker."""
    log = tmp_path / "reads.jsonl"
    job = old_style / "job.yaml"
    job.write_text(yaml.safe_dump(old_style_job(log, name="old-style-cli")))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PIPETUNE_HOME"] = str(tmp_path / "home")
    proc = subprocess.run([*PIPETUNE, "tune", "job.yaml"], cwd=old_style, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    train, evaluate = read_log(log)
    assert set(train) == set(evaluate) and len(train) == 6  # 2 trials x 3 epochs
    assert all(row["pid"] != os.getpid() for row in train.values())

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{old_style / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("pipetune")
    (parent,) = client.search_runs([experiment.experiment_id],
                                   "tags.`pipetune.kind` = 'study'")
    children = client.search_runs(
        [experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(children) == 2
    chosen = {}
    for child in children:
        assert child.data.tags["outcome"] == "completed", child.data.tags
        seed = int(child.data.params["seed"])
        history = {knob: {m.step: m.value for m in client.get_metric_history(
            child.info.run_id, f"sys_{knob}")} for knob in (
                "cores", "dataloader_workers", "channels_last", "compile")}
        for epoch in (1, 2, 3):
            chosen[(seed, epoch)] = SystemConfig(
                cores=int(history["cores"][epoch]),
                dataloader_workers=int(history["dataloader_workers"][epoch]),
                channels_last=bool(history["channels_last"][epoch]),
                compile=bool(history["compile"][epoch]))
    assert set(chosen) == set(train)
    for key, system in chosen.items():
        assert_read_as_chosen(train[key], system)
        assert 1 <= len(evaluate[key]) <= 2  # the best trial's last epoch again at the end
        for row in evaluate[key]:
            assert_read_as_chosen(row, system)
        assert_honoured(train[key], system)
    assert sum(len(rows) for rows in evaluate.values()) == 7  # 6 epochs and the best model
    assert any(s.dataloader_workers == 1 for s in chosen.values())
    assert any(s.channels_last for s in chosen.values())


def test_an_old_style_workload_called_by_hand_with_either_config(tmp_path, old_style):
    import old_style_workload

    config = SystemConfig(channels_last=True)
    for i, system in enumerate((config, applied_context(config))):
        log = tmp_path / f"reads-{i}.jsonl"
        workload = old_style_workload.OldStyleWorkload(log=str(log))
        workload.setup({"lr": 0.05}, seed=7)
        with applied_system_config(config):
            stats = workload.train_epoch(system)
            metrics = workload.evaluate(system)
        assert stats.samples == 64 and stats.steps == 4
        assert set(metrics) == {"accuracy", "val_loss"}
        train, evaluate = read_log(log)
        assert set(train) == set(evaluate) == {(7, 1)}
        assert_read_as_chosen(train[(7, 1)], config)
        (row,) = evaluate[(7, 1)]
        assert_read_as_chosen(row, config)
        assert_honoured(train[(7, 1)], config)


# -- what a workload is given ---------------------------------------------------------------

def test_every_knob_reads_as_an_attribute_without_a_warning():
    config = SystemConfig(cores=2, interop_threads=2, dataloader_workers=3,
                          omp_wait_policy="passive", pin_cores=True, channels_last=True,
                          compile=True)
    applied = applied_context(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert {knob: getattr(applied, knob) for knob in KNOBS} == config.to_dict()
        # The helpers answer beside them, unchanged.
        assert applied.memory_format == torch.channels_last
        assert applied.loader_options()["num_workers"] == 3
        assert applied.config is config
    with pytest.raises(AttributeError, match="read-only"):
        applied.cores = 4
    assert applied.cores == 2


def test_the_device_is_the_knobs_string_and_a_torch_device_alike():
    device = applied_context(SystemConfig()).device
    assert isinstance(device, Device) and isinstance(device, str)
    assert device == "cpu" and device != "cuda"
    assert device == torch.device("cpu") and torch.device("cpu") == device
    assert not device != torch.device("cpu")
    assert (device.type, device.index) == ("cpu", None)
    assert Device("cuda:1").index == 1 and Device("cuda:1").type == "cuda"
    assert {"cpu": 1}[device] == 1 and hash(device) == hash("cpu")
    assert torch.zeros(2, device=device).device == torch.device("cpu")
    assert torch.zeros(2).to(device).device.type == "cpu"
    assert next(torch.nn.Linear(2, 2).to(device).parameters()).device.type == "cpu"
    assert torch.device(device) == torch.device("cpu")
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        pass
    assert pickle.loads(pickle.dumps(device)) == device
    if not torch.cuda.is_available():
        with pytest.raises(WorkloadError, match="torch sees no CUDA device"):
            _ = applied_context(SystemConfig(device="cuda")).device


@pytest.mark.parametrize(
    ("name", "call", "expected"),
    [
        ("label", lambda m: m(), "cores=2 interop=1 workers=1 channels_last"),
        ("to_dict", lambda m: m(), SystemConfig(cores=2, dataloader_workers=1,
                                                channels_last=True).to_dict()),
        ("replace", lambda m: m(cores=1),
         SystemConfig(cores=1, dataloader_workers=1, channels_last=True)),
        ("as_metrics", lambda m: m()["sys_dataloader_workers"], 1.0),
        ("one_time_knobs", lambda m: m(), ()),
        ("check_machine", lambda m: m(MachineInfo(cores=4)), None),
    ],
)
def test_what_else_a_system_config_had_warns_and_answers(name, call, expected):
    applied = applied_context(SystemConfig(cores=2, dataloader_workers=1, channels_last=True))
    with pytest.warns(DeprecationWarning, match=rf"use system\.config\.{name}") as caught:
        value = call(getattr(applied, name))
    assert value == expected
    assert len(caught) == 1 and caught[0].filename == __file__  # points at the caller


def test_every_other_system_config_member_is_answered():
    applied = applied_context(SystemConfig(cores=2))
    members = {n for n in dir(SystemConfig) if not n.startswith("_")} - set(KNOBS)
    assert members >= {"label", "to_dict", "replace", "as_metrics"}
    for name in members:
        with pytest.warns(DeprecationWarning, match=f"system.config.{name}"):
            assert getattr(applied, name) == getattr(applied.config, name)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = applied.nothing


def test_an_applied_config_copies_pickles_and_hashes():
    applied = AppliedConfig(SystemConfig(cores=2), notes=["a note"], actual={"threads": 2})
    for again in (pickle.loads(pickle.dumps(applied)), copy.copy(applied),
                  copy.deepcopy(applied)):
        assert again == applied and again.cores == 2 and again.notes == ["a note"]
    assert hash(applied) == hash(AppliedConfig(SystemConfig(cores=2)))
    # An instance with no config yet (as unpickling makes one) answers no attribute.
    bare = AppliedConfig.__new__(AppliedConfig)
    with pytest.raises(AttributeError):
        _ = bare.label
    assert not hasattr(bare, "__setstate__")


# -- job files of the previous release -------------------------------------------------------

def test_a_job_file_of_the_previous_release_stays_valid(tmp_path):
    path = tmp_path / "lenet_digits.yaml"
    path.write_text(PREVIOUS_RELEASE_JOB)
    from_file = load_spec(path, machine=MACHINE)
    from_dict = JobSpec.from_dict(yaml.safe_load(PREVIOUS_RELEASE_JOB), machine=MACHINE)
    assert from_file == from_dict
    assert from_file.name == "lenet-digits" and from_file.workload.name == "lenet5"
    assert from_file.workload.params == {"dataset": "digits", "train_samples": 1200,
                                         "val_samples": 400}
    assert from_file.system.default == SystemConfig()
    assert from_file.system.space == {"cores": [1, 2], "dataloader_workers": [0, 1]}
    assert (from_file.search.algorithm, from_file.search.trials) == ("tpe", 6)
    assert from_file.early_stopping.max_epochs == 3
    assert from_file.pipetune.probe_plan == "one_knob"
    assert from_file.profiler.op_mix_steps == 10
    # What the later releases added takes its default.
    assert from_file.workload.deterministic is False
    assert from_file.pipetune.compile_cache == ""
    proc = subprocess.run([*PIPETUNE, "validate", str(path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PIPETUNE_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
