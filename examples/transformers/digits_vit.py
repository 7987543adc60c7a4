"""A Hugging Face Trainer job tuned by pipetune as it is: a small Vision Transformer built
from its config (no weights downloaded) classifying scikit-learn's bundled 8x8 digits.
``model_init``, the datasets, ``TrainingArguments`` and ``compute_metrics`` are what
``Trainer`` takes; ``transformers_workload`` makes them a workload.

    pip install 'pipetune[transformers]'
    python digits_vit.py                  # pipetune.tune() from Python
    pipetune tune job.yaml                # the same study from the command line
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import ViTConfig, ViTForImageClassification

from pipetune.integrations.transformers import transformers_workload


class Digits(Dataset):
    """Digits ``lo:hi`` of scikit-learn's 1,797 as 1x8x8 images."""

    def __init__(self, lo: int, hi: int):
        from sklearn.datasets import load_digits

        digits = load_digits()
        self.images = torch.tensor(digits.data[lo:hi], dtype=torch.float32).view(-1, 1, 8, 8)
        self.images /= 16.0
        self.labels = torch.tensor(digits.target[lo:hi])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.images[i], "labels": self.labels[i]}


def vit(hp: dict) -> ViTForImageClassification:
    """The trial's model: hyperparameters that are not TrainingArguments fields."""
    return ViTForImageClassification(ViTConfig(
        image_size=8, patch_size=2, num_channels=1, hidden_size=hp["hidden"],
        num_hidden_layers=hp["layers"], num_attention_heads=4,
        intermediate_size=2 * hp["hidden"], num_labels=10))


def accuracy(prediction) -> dict[str, float]:
    return {"accuracy": float((np.argmax(prediction.predictions, -1)
                               == prediction.label_ids).mean())}


#: What job.yaml names (digits_vit:workload).
workload = transformers_workload(
    model_init=vit,
    train_dataset=Digits(0, 1400),
    eval_dataset=Digits(1400, 1797),
    # The schedule's horizon: the job's early_stopping.max_epochs.
    args={"per_device_train_batch_size": 32, "num_train_epochs": 4,
          "per_device_eval_batch_size": 256},
    compute_metrics=accuracy,
    metrics=("accuracy", "loss"),
    hparams={"hidden": 64, "layers": 2, "learning_rate": 3e-3},
)


if __name__ == "__main__":
    import pipetune

    trials = int(sys.argv[1]) if len(sys.argv) > 1 else None
    result = pipetune.tune(Path(__file__).with_name("job.yaml"), trials=trials)
    print(result)
    print(result.trials_dataframe()[["trial", "state", "value", "epochs", "system"]]
          .to_string(index=False))
    model = result.load_best_model()  # the best trial's ViTForImageClassification
    print(f"best model: {type(model).__name__}, {model.num_parameters()} parameters; "
          f"MLflow: {result.links['mlflow']}")
