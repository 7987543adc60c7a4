"""The Lightning integration: LightningModule and LightningDataModule code tuned as it
is, in real studies on the embedded default (the example as a user runs it; a script
of its own with a callback), and a workload's epochs continued from Lightning's own
checkpoints."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from known import configs_run, run_example, user_env

pl = pytest.importorskip("pytorch_lightning")
import torch  # noqa: E402

from pipetune.errors import WorkloadError  # noqa: E402
from pipetune.system.config import SystemConfig  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lightning"


@pytest.mark.slow
def test_the_example_tunes_its_lightning_module_from_python(tmp_path):
    proc, client, parent, trials = run_example(tmp_path, EXAMPLE, "digits.py", "2")
    assert "best model: DigitsClassifier, " in proc.stdout
    assert parent.data.params["workload"] == "digits:workload"
    assert parent.info.status == "FINISHED"
    assert len(trials) == 2
    # Its epochs ran under more than one system config (a probe at least), as recorded.
    configs = configs_run(client, trials, ('sys_interop_threads', 'sys_dataloader_workers'))
    assert len(configs) > 1, configs
    for run in trials:
        history = client.get_metric_history(run.info.run_id, "val_acc")
        assert history and all(0.0 <= m.value <= 1.0 for m in history)


SCRIPT = '''
import json, sys
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import pipetune
from pipetune.integrations.lightning import lightning_workload


class Blobs(pl.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Linear(2, 2)

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, i):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class Data(pl.LightningDataModule):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        y = torch.randint(0, 2, (512,), generator=g)
        x = torch.randn(512, 2, generator=g) + 2.0 * y[:, None]
        self.train, self.val = TensorDataset(x[:384], y[:384]), TensorDataset(x[384:], y[384:])

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=32, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=128)


class EpochsSeen(pl.Callback):
    """The user's own callback: logs the epoch Lightning is in (0-based)."""

    def on_validation_epoch_end(self, trainer, module):
        module.log("epoch_seen", float(trainer.current_epoch))


workload = lightning_workload(module=lambda hp: Blobs(hp["lr"]), datamodule=lambda hp: Data(),
                              metrics=("val_acc",), hparams={"lr": 0.05},
                              trainer={"callbacks": [EpochsSeen()]})

if __name__ == "__main__":
    result = pipetune.tune(json.loads(sys.argv[1]), workload=workload, progress=False)
    print(json.dumps({"epochs": result.epochs_dataframe().to_dict("records"),
                      "trials": result.trials_dataframe().to_dict("records"),
                      "model": type(result.load_best_model()).__name__,
                      "best": result.best_value}, default=str))
'''


@pytest.mark.slow
def test_a_notebooks_lightning_code_goes_on_epoch_after_epoch_with_its_callbacks(tmp_path):
    job = {
        "name": "lightning-blobs",
        "hyperparameters": {"lr": {"type": "loguniform", "low": 0.01, "high": 0.1}},
        "system": {"default": {"cores": 1, "interop_threads": 1},
                   "space": {"interop_threads": [1, 2]}},
        "search": {"algorithm": "random", "trials": 2, "seed": 0, "max_concurrent": 2},
        "early_stopping": {"policy": "none", "max_epochs": 3},
        "objective": {"metric": "val_acc", "mode": "max", "system": "time"},
    }
    (tmp_path / "mine.py").write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "mine.py", json.dumps(job)], cwd=tmp_path,
                          env=user_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    epochs = out["epochs"]
    assert len(epochs) == 6 and all(t["state"] == "completed" for t in out["trials"])
    # Each pipetune epoch is the next Lightning epoch of its trial (continued from the
    # trial's checkpoint, whichever worker ran it), and the user's callback ran in it.
    for e in epochs:
        assert e["metrics.epoch_seen"] == e["epoch"] - 1, e
    assert {e["phase"] for e in epochs} >= {"profile", "train"}
    assert out["model"] == "Blobs" and out["best"] > 0.8
    # The checkpoints kept are Lightning's: model, optimiser and loops, read back as
    # pipetune reads its checkpoints (torch.load with weights_only=True).
    last = [e for e in epochs if e["epoch"] == 3][0]
    state = torch.load(last["checkpoint"], weights_only=True)
    assert state["epoch"] == 3 and state["global_step"] == 3 * 12
    assert state["optimizer_states"][0]["state"]  # momentum buffers went on
    assert "pytorch-lightning_version" in state and "net.weight" in state["state_dict"]


# -- in this process ---------------------------------------------------------------------

def _digits_workload(**trainer):
    sys.path.insert(0, str(EXAMPLE))
    try:
        import digits
    finally:
        sys.path.remove(str(EXAMPLE))
    from pipetune.integrations.lightning import lightning_workload

    return lightning_workload(
        module=lambda hp: digits.DigitsClassifier(32, hp["lr"], 0.9),
        datamodule=lambda hp: digits.Digits(64), metrics=("val_acc",),
        hparams={"lr": 0.1}, trainer=trainer)


def test_a_checkpoint_taken_elsewhere_goes_on_where_it_stopped():
    workload = _digits_workload()
    first = workload()
    first.setup({}, seed=0)
    config = SystemConfig(cores=1)
    for _ in range(2):
        first.train_epoch(config)
        first.evaluate(config)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # as pipetune's checkpoint store reads
    second = workload()  # another worker
    second.setup({}, seed=1)
    second.load_state_dict(state)
    assert second.evaluate(config) == pytest.approx(first.evaluate(config))
    second.train_epoch(config)
    third = second.state_dict()
    assert third["epoch"] == 3 and third["global_step"] == state["global_step"] * 3 // 2


def test_trainer_arguments_the_system_config_owns_are_refused_by_name():
    workload = _digits_workload(precision="16-mixed")()
    workload.setup({}, seed=0)
    with pytest.raises(WorkloadError, match="trainer arguments precision are set per epoch"):
        workload.train_epoch(SystemConfig(cores=1))
