"""Hugging Face ``Trainer`` code tuned as it is (``pip install 'pipetune[transformers]'``).

A ``model_init``, the train and eval datasets and the ``TrainingArguments`` become a
workload, as they would go to ``Trainer``::

    from pipetune.integrations.transformers import transformers_workload

    workload = transformers_workload(
        model_init=lambda hp: BertForSequenceClassification(config(hp)),
        train_dataset=train, eval_dataset=val,          # or functions of the hyperparameters
        args={"per_device_train_batch_size": 32, "num_train_epochs": 4},
        compute_metrics=accuracy,                       # EvalPrediction -> {"accuracy": ...}
        metrics=("accuracy", "loss"),                   # compute_metrics keys, objective first
    )

Hyperparameters named like a ``TrainingArguments`` field (``learning_rate``,
``weight_decay``, ``per_device_train_batch_size``, ...) set that field, as
``Trainer.hyperparameter_search`` does; the others go to ``model_init``.

Each pipetune epoch is one Trainer epoch: ``trainer.train(resume_from_checkpoint=...)``
from the trial's last Trainer checkpoint (model, optimiser, scheduler, trainer state,
RNG), stopped at the end of that epoch. The schedule's horizon is the arguments'
``num_train_epochs`` (set it to the job's ``early_stopping.max_epochs``), as in one
long ``train()``. The checkpoint pipetune keeps is the Trainer's checkpoint folder, its
files as byte tensors (``torch.load(weights_only=True)`` reads it).

The epoch's system config goes in ``TrainingArguments``: ``bf16`` / ``fp16`` from
``precision``, ``torch_compile`` from ``compile``, ``dataloader_num_workers`` from
``dataloader_workers``, ``use_cpu`` from ``device``; ``channels_last`` is the model's
memory format; the threads are set by pipetune as for every workload. The metrics are
``trainer.evaluate()``'s, each also under its ``compute_metrics`` key (``accuracy`` for
``eval_accuracy``).
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from pipetune.errors import WorkloadError
from pipetune.workloads import StepHook, TrainStats, Workload

#: ``TrainingArguments`` fields pipetune sets every epoch (the study's and the system
#: config's); a user's value for one is refused by name.
OWNED_ARGS = ("output_dir", "save_strategy", "save_total_limit", "eval_strategy", "bf16",
              "fp16", "torch_compile", "dataloader_num_workers", "use_cpu", "seed",
              "resume_from_checkpoint", "load_best_model_at_end")
#: Quiet defaults under pipetune (a user's arguments win): pipetune records the run.
QUIET_ARGS = {"report_to": "none", "disable_tqdm": True, "logging_strategy": "no"}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise WorkloadError("the Hugging Face integration needs transformers and accelerate: "
                            "pip install 'pipetune[transformers]'") from None
    global _quieted
    if not _quieted:  # a worker's log: no progress bar per checkpoint written, no advice
        _quieted = True
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    return transformers


_quieted = False


class TransformersWorkload(Workload):
    """A workload whose epochs are ``Trainer`` epochs; made by
    :func:`transformers_workload`."""

    model_factory: ClassVar[Callable[[dict[str, Any]], Any]]
    #: Datasets, or functions of the hyperparameters that return them.
    train_data: ClassVar[Any]
    eval_data: ClassVar[Any]
    #: ``TrainingArguments`` keyword arguments.
    training_args: ClassVar[Mapping[str, Any]] = {}
    compute_metrics: ClassVar[Callable[[Any], dict[str, float]] | None] = None
    data_collator: ClassVar[Any] = None
    trainer_callbacks: ClassVar[tuple[Any, ...]] = ()
    hparam_defaults: ClassVar[Mapping[str, Any]] = {}
    metrics: ClassVar[tuple[str, ...]] = ("loss",)

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.hparams: dict[str, Any] | None = None
        self.model: Any = None
        self._seed = 0
        self._epoch = 0
        self._folder = Path(tempfile.mkdtemp(prefix="pipetune-hf-"))
        self._ckpt: Path | None = None  # the trial's last Trainer checkpoint folder, here
        self._trainer: Any = None  # the last epoch's, for its evaluation
        self._steps = 0  # optimiser steps of the trial so far

    def setup(self, hparams: Mapping[str, Any], seed: int) -> None:
        transformers = _transformers()
        self.hparams = {**self.hparam_defaults, **hparams}
        self._seed = seed
        transformers.set_seed(seed)
        self.model = type(self).model_factory(self._model_hparams())
        self._epoch, self._ckpt, self._trainer, self._steps = 0, None, None, 0

    @property
    def batch_size(self) -> int:
        if self.hparams is None:
            raise WorkloadError(f"workload {self.name!r}: batch_size is known only after setup()")
        return int(self._args_given().get("per_device_train_batch_size", 8))

    def train_epoch(self, system: Any, on_step: StepHook | None = None) -> TrainStats:
        from pipetune.system.apply import applied_context

        ctx = applied_context(system)
        if ctx.config.channels_last:
            self.model = self.model.to(memory_format=ctx.memory_format)
        trainer = self._new_trainer(ctx, on_step)
        out = trainer.train(resume_from_checkpoint=str(self._ckpt) if self._ckpt else None)
        self._epoch = int(round(trainer.state.epoch or 0))
        self._ckpt = self._last_checkpoint()
        self._trainer = trainer
        steps, self._steps = out.global_step - self._steps, out.global_step
        return TrainStats(loss=float(out.training_loss), samples=_samples(trainer),
                          steps=int(steps))

    def evaluate(self, system: Any) -> dict[str, float]:
        trainer = self._trainer
        if trainer is None:  # loaded, not trained here
            from pipetune.system.apply import applied_context

            trainer = self._new_trainer(applied_context(system), None)
        self._trainer = None
        out = {k: float(v) for k, v in trainer.evaluate().items()
               if isinstance(v, (int, float))}
        out.update({k.removeprefix("eval_"): v for k, v in out.items()
                    if k.startswith("eval_")})
        return out

    def state_dict(self) -> dict[str, Any]:
        """The trial's last Trainer checkpoint folder, each file as a byte tensor."""
        import torch

        if self._ckpt is None:
            raise WorkloadError(f"workload {self.name!r}: no epoch trained yet, no checkpoint")
        files = {p.name: torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8)
                 for p in sorted(self._ckpt.iterdir()) if p.is_file()}
        return {"files": files, "folder": self._ckpt.name, "epoch": self._epoch,
                "global_step": self._steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        folder = self._folder / "loaded" / str(state["folder"])
        shutil.rmtree(folder.parent, ignore_errors=True)
        folder.mkdir(parents=True)
        for name, data in state["files"].items():
            (folder / name).write_bytes(data.numpy().tobytes())
        self._ckpt, self._epoch = folder, int(state["epoch"])
        self._steps = int(state.get("global_step", 0))
        self._load_weights(folder)

    def trained_model(self) -> Any:
        """The model (its weights as trained or loaded)."""
        return self.model

    # -- the Trainer ------------------------------------------------------------------
    def _model_hparams(self) -> dict[str, Any]:
        fields = _argument_fields()
        return {k: v for k, v in (self.hparams or {}).items() if k not in fields}

    def _args_given(self) -> dict[str, Any]:
        """The user's arguments, the trial's hyperparameters that name a field over them."""
        fields = _argument_fields()
        given = dict(self.training_args)
        given.update({k: v for k, v in (self.hparams or {}).items() if k in fields})
        return given

    def _new_trainer(self, ctx: Any, on_step: StepHook | None) -> Any:
        transformers = _transformers()
        given = self._args_given()
        owned = sorted(set(given) & set(OWNED_ARGS))
        if owned:
            raise WorkloadError(
                f"workload {self.name!r}: TrainingArguments {', '.join(owned)} are set per "
                "epoch by pipetune (the checkpoints, the seed, and the system config: "
                "precision, compile, dataloader_workers, device)")
        horizon = max(float(given.pop("num_train_epochs", 3.0)), self._epoch + 1)
        config = ctx.config
        args = transformers.TrainingArguments(
            **{**QUIET_ARGS, **given},
            output_dir=str(self._folder / "run"), num_train_epochs=horizon,
            save_strategy="epoch", save_total_limit=1, eval_strategy="no",
            bf16=config.precision == "bf16", fp16=config.precision == "fp16",
            torch_compile=bool(config.compile),
            dataloader_num_workers=config.dataloader_workers,
            use_cpu=config.device != "cuda", seed=self._seed)
        callbacks = [*self.trainer_callbacks, _OneEpoch(transformers, on_step)]
        hp = self._model_hparams()
        trainer = transformers.Trainer(
            model=self.model, args=args, data_collator=self.data_collator,
            train_dataset=_data(self.train_data, hp), eval_dataset=_data(self.eval_data, hp),
            compute_metrics=type(self).compute_metrics, callbacks=callbacks)
        if args.disable_tqdm:  # its logs as printed dicts: pipetune records them
            trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        return trainer

    def _last_checkpoint(self) -> Path:
        run = self._folder / "run"
        found = sorted(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
        if not found:
            raise WorkloadError(f"workload {self.name!r}: the Trainer saved no checkpoint in "
                                f"{run}")
        return found[-1]

    def _load_weights(self, folder: Path) -> None:
        """The checkpoint's weights into the model, by the model's own loader: a
        ``PreTrainedModel`` by ``from_pretrained`` (transformers 5 saves some
        architectures under older key names, ViT's among them, and ``Trainer``'s own
        resume, a plain ``load_state_dict(strict=False)``, then loads none of them:
        what it does not load stays as loaded here)."""
        if hasattr(self.model, "from_pretrained") and (folder / "config.json").exists():
            self.model = type(self.model).from_pretrained(str(folder))
            return
        import torch

        weights = folder / "model.safetensors"
        if weights.exists():
            from safetensors.torch import load_file

            self.model.load_state_dict(load_file(str(weights)))
        else:
            self.model.load_state_dict(torch.load(folder / "pytorch_model.bin",
                                                  weights_only=True))


def _OneEpoch(transformers: Any, on_step: StepHook | None) -> Any:  # noqa: N802
    class OneEpoch(transformers.TrainerCallback):
        """Ends ``train()`` at the end of the epoch it is in (its checkpoint is saved
        first), and tells the profiler each optimiser step."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if on_step is not None:
                on_step()

        def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            control.should_training_stop = True

    return OneEpoch()


def _data(data: Any, hparams: dict[str, Any]) -> Any:
    if callable(data) and not hasattr(data, "__getitem__"):
        return data(hparams)
    return data


def _samples(trainer: Any) -> int:
    try:
        return len(trainer.train_dataset)
    except TypeError:
        return 0


_fields_cache: frozenset[str] | None = None


def _argument_fields() -> frozenset[str]:
    global _fields_cache
    if _fields_cache is None:
        _fields_cache = frozenset(
            f.name for f in dataclasses.fields(_transformers().TrainingArguments))
    return _fields_cache


def transformers_workload(*, model_init: Callable[[dict[str, Any]], Any],
                          train_dataset: Any, eval_dataset: Any,
                          args: Mapping[str, Any] | None = None,
                          compute_metrics: Callable[[Any], dict[str, float]] | None = None,
                          metrics: tuple[str, ...] | list[str] = ("loss",),
                          data_collator: Any = None, callbacks: tuple[Any, ...] | list[Any] = (),
                          hparams: Mapping[str, Any] | None = None,
                          name: str | None = None) -> type[TransformersWorkload]:
    """A :class:`TransformersWorkload` subclass: ``model_init(hparams)`` builds the
    trial's model; the datasets (or functions of the hyperparameters returning them),
    ``args`` (``TrainingArguments`` keywords), ``compute_metrics``, ``data_collator``
    and ``callbacks`` go to every epoch's ``Trainer``; ``metrics`` names what
    ``compute_metrics`` returns (or ``loss``), the first the default objective;
    ``hparams`` the defaults."""
    if not callable(model_init):
        raise WorkloadError("transformers_workload: model_init must be a callable taking the "
                            "trial's hyperparameters (a dict)")
    if not metrics:
        raise WorkloadError("transformers_workload: metrics must name compute_metrics keys")
    caller = sys._getframe(1).f_globals.get("__name__", __name__)
    class_name = name if name and name.isidentifier() else "transformers_workload"
    namespace = {
        "__module__": caller, "__qualname__": class_name,
        "__doc__": "A Hugging Face Trainer workload made by transformers_workload.",
        "model_factory": staticmethod(model_init), "train_data": train_dataset,
        "eval_data": eval_dataset, "training_args": dict(args or {}),
        "compute_metrics": staticmethod(compute_metrics) if compute_metrics else None,
        "data_collator": data_collator, "trainer_callbacks": tuple(callbacks),
        "hparam_defaults": dict(hparams or {}), "metrics": tuple(metrics),
    }
    return type(class_name, (TransformersWorkload,), namespace)


__all__ = ["TransformersWorkload", "transformers_workload"]
