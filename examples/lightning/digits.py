"""A Lightning classifier of scikit-learn's bundled 8x8 digits (nothing downloaded),
tuned by pipetune as it is: the LightningModule and the LightningDataModule are plain
Lightning code; ``lightning_workload`` makes them a workload.

    pip install 'pipetune[lightning]'
    python digits.py                      # pipetune.tune() from Python
    pipetune tune job.yaml                # the same study from the command line
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from pipetune.integrations.lightning import lightning_workload


class DigitsClassifier(pl.LightningModule):
    def __init__(self, hidden: int = 64, lr: float = 0.05, momentum: float = 0.9):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr,
                               momentum=self.hparams.momentum)


class Digits(pl.LightningDataModule):
    """1,400 digits to train on, the other 397 to validate on."""

    def __init__(self, batch_size: int = 64):
        super().__init__()
        self.batch_size = batch_size
        self.num_workers = 0  # pipetune sets it from each epoch's dataloader_workers

    def setup(self, stage=None):
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target)
        self.train_set = TensorDataset(x[:1400], y[:1400])
        self.val_set = TensorDataset(x[1400:], y[1400:])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True,
                          num_workers=self.num_workers)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=256, num_workers=self.num_workers)


#: What job.yaml names (digits:workload).
workload = lightning_workload(
    module=lambda hp: DigitsClassifier(hp["hidden"], hp["lr"], hp["momentum"]),
    datamodule=lambda hp: Digits(hp["batch_size"]),
    metrics=("val_acc", "val_loss"),
    hparams={"hidden": 64, "lr": 0.05, "momentum": 0.9, "batch_size": 64},
)


if __name__ == "__main__":
    import pipetune

    trials = int(sys.argv[1]) if len(sys.argv) > 1 else None
    result = pipetune.tune(Path(__file__).with_name("job.yaml"), trials=trials)
    print(result)
    print(result.trials_dataframe()[["trial", "state", "value", "epochs", "system"]]
          .to_string(index=False))
    model = result.load_best_model()  # the best trial's DigitsClassifier
    print(f"best model: {type(model).__name__}, {sum(p.numel() for p in model.parameters())} "
          f"parameters; MLflow: {result.links['mlflow']}")
