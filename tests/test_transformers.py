"""The Hugging Face Trainer integration: ``model_init``, datasets and
``TrainingArguments`` tuned as they are, in real studies on the embedded default (the
example as a user runs it; a script of its own with a callback), and a workload's
epochs continued from the Trainer's own checkpoints."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from known import configs_run, run_example, user_env

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import torch  # noqa: E402

from pipetune.errors import WorkloadError  # noqa: E402
from pipetune.system.config import SystemConfig  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "transformers"


@pytest.mark.slow
def test_the_example_tunes_its_trainer_job_from_python(tmp_path):
    proc, client, parent, trials = run_example(tmp_path, EXAMPLE, "digits_vit.py", "2")
    assert "best model: ViTForImageClassification, " in proc.stdout
    assert parent.data.params["workload"] == "digits_vit:workload"
    assert parent.info.status == "FINISHED"
    assert len(trials) == 2
    # Its epochs ran under more than one system config (a probe at least), as recorded.
    configs = configs_run(client, trials, ('sys_interop_threads', 'sys_channels_last'))
    assert len(configs) > 1, configs
    for run in trials:
        history = client.get_metric_history(run.info.run_id, "accuracy")
        assert history and all(0.0 <= m.value <= 1.0 for m in history)
        assert "learning_rate" in run.data.params  # a TrainingArguments field, tuned


SCRIPT = '''
import json, sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import TrainerCallback, ViTConfig, ViTForImageClassification

import pipetune
from pipetune.integrations.transformers import transformers_workload


class Blobs(Dataset):
    def __init__(self, lo, hi):
        g = torch.Generator().manual_seed(0)
        y = torch.randint(0, 2, (512,), generator=g)
        x = torch.randn(512, 1, 4, 4, generator=g) + 1.5 * y[:, None, None, None]
        self.x, self.y = x[lo:hi], y[lo:hi]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"pixel_values": self.x[i], "labels": self.y[i]}


class EpochsSeen(TrainerCallback):
    """The user's own callback: writes down each epoch the Trainer ends."""

    def on_epoch_end(self, args, state, control, **kwargs):
        with open(Path(sys.argv[2]) / "epochs.txt", "a") as f:
            f.write(f"{state.epoch:.0f} {state.global_step}\\n")


def accuracy(p):
    return {"accuracy": float((np.argmax(p.predictions, -1) == p.label_ids).mean())}


workload = transformers_workload(
    model_init=lambda hp: ViTForImageClassification(ViTConfig(
        image_size=4, patch_size=2, num_channels=1, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32, num_labels=2)),
    train_dataset=Blobs(0, 384), eval_dataset=Blobs(384, 512), compute_metrics=accuracy,
    args={"per_device_train_batch_size": 32, "num_train_epochs": 3}, metrics=("accuracy",),
    callbacks=[EpochsSeen()], hparams={"learning_rate": 0.01})

if __name__ == "__main__":
    result = pipetune.tune(json.loads(sys.argv[1]), workload=workload, progress=False)
    print(json.dumps({"epochs": result.epochs_dataframe().to_dict("records"),
                      "trials": result.trials_dataframe().to_dict("records"),
                      "model": type(result.load_best_model()).__name__,
                      "best": result.best_value}, default=str))
'''


@pytest.mark.slow
def test_a_notebooks_trainer_code_goes_on_epoch_after_epoch_with_its_callbacks(tmp_path):
    job = {
        "name": "hf-blobs",
        "hyperparameters": {"learning_rate": {"type": "loguniform", "low": 0.005,
                                              "high": 0.02}},
        "system": {"default": {"cores": 1, "interop_threads": 1},
                   "space": {"interop_threads": [1, 2]}},
        "search": {"algorithm": "random", "trials": 2, "seed": 0, "max_concurrent": 2},
        "early_stopping": {"policy": "none", "max_epochs": 3},
        "objective": {"metric": "accuracy", "mode": "max", "system": "time"},
    }
    (tmp_path / "mine.py").write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "mine.py", json.dumps(job), str(tmp_path)],
                          cwd=tmp_path, env=user_env(tmp_path), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    epochs = out["epochs"]
    assert len(epochs) == 6 and all(t["state"] == "completed" for t in out["trials"])
    assert all(e["metrics.accuracy"] == e["metrics.eval_accuracy"] for e in epochs)
    # The user's callback ended every epoch of both trials, each the Trainer's next
    # epoch (its state and step count continued from the trial's checkpoint).
    ended = sorted((tmp_path / "epochs.txt").read_text().split("\n")[:-1])
    assert ended == sorted(["1 12", "2 24", "3 36"] * 2)
    assert out["model"] == "ViTForImageClassification" and out["best"] > 0.7
    # The checkpoint kept is the Trainer's checkpoint folder, file by file.
    last = [e for e in epochs if e["epoch"] == 3][0]
    state = torch.load(last["checkpoint"], weights_only=True)
    assert state["epoch"] == 3 and state["global_step"] == 36
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt",
            "trainer_state.json"} <= set(state["files"])
    trainer_state = json.loads(state["files"]["trainer_state.json"].numpy().tobytes())
    assert trainer_state["global_step"] == 36


# -- in this process ---------------------------------------------------------------------

def _vit_workload(**args):
    sys.path.insert(0, str(EXAMPLE))
    try:
        import digits_vit
    finally:
        sys.path.remove(str(EXAMPLE))
    from pipetune.integrations.transformers import transformers_workload

    return transformers_workload(
        model_init=digits_vit.vit, train_dataset=digits_vit.Digits(0, 640),
        eval_dataset=digits_vit.Digits(1400, 1797), compute_metrics=digits_vit.accuracy,
        metrics=("accuracy",), hparams={"hidden": 32, "layers": 1, "learning_rate": 3e-3},
        args={"per_device_train_batch_size": 64, "num_train_epochs": 3, **args})


def test_a_checkpoint_taken_elsewhere_goes_on_where_it_stopped():
    workload = _vit_workload()
    first = workload()
    first.setup({}, seed=0)
    config = SystemConfig(cores=1)
    for _ in range(2):
        first.train_epoch(config)
        before = first.evaluate(config)["accuracy"]
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # as pipetune's checkpoint store reads
    second = workload()  # another worker
    second.setup({}, seed=1)
    second.load_state_dict(state)
    # ViT's weights are saved under older key names by transformers 5: loaded anyway.
    assert second.evaluate(config)["accuracy"] == pytest.approx(before)
    stats = second.train_epoch(config)
    assert stats.steps == 10 and second.state_dict()["global_step"] == 30


def test_training_arguments_pipetune_sets_are_refused_by_name():
    workload = _vit_workload(bf16=True)()
    workload.setup({}, seed=0)
    with pytest.raises(WorkloadError, match="TrainingArguments bf16 are set per epoch"):
        workload.train_epoch(SystemConfig(cores=1))
