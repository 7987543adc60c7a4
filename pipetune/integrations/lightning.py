"""PyTorch Lightning code tuned as it is (``pip install 'pipetune[lightning]'``).

A LightningModule factory and a LightningDataModule factory, each taking the trial's
hyperparameters (a dict), become a workload::

    from pipetune.integrations.lightning import lightning_workload

    workload = lightning_workload(
        module=lambda hp: Classifier(lr=hp["lr"]),
        datamodule=lambda hp: Digits(batch_size=hp["batch_size"]),
        metrics=("val_acc", "val_loss"),          # what the module logs in validation
        hparams={"lr": 0.05, "batch_size": 64},   # defaults; the job's space overrides
        trainer={"callbacks": [MyCallback()]},    # more Trainer arguments, kept every epoch
    )
    pipetune.tune(job, workload=workload)         # or a job file: my_module:workload

Each pipetune epoch is one Lightning epoch: a ``Trainer(max_epochs=n)`` fitting from the
trial's last Lightning checkpoint (``trainer.fit(..., ckpt_path=...)``), so the model,
its optimisers and schedulers, the loops and the callbacks' state go on where the
trial's last epoch left them, on whichever worker. The checkpoint pipetune keeps for
each epoch is Lightning's own (``trainer.save_checkpoint``), loadable with
``LightningModule.load_from_checkpoint`` or ``fit(ckpt_path=...)``.

The epoch's system config reaches Lightning the way Lightning takes it: ``precision``
as the Trainer's ``precision`` (``32-true``, ``bf16-mixed``, ``16-mixed``), ``device`` as
its ``accelerator`` (one device), ``compile`` as ``torch.compile`` of the module,
``channels_last`` as the module's memory format, ``dataloader_workers`` as the data
module's ``num_workers`` attribute (where it has one: its loaders read it), and the
threads as pipetune sets them for every workload. The metrics are what the module
logged in the epoch's validation (``trainer.callback_metrics``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from pipetune.errors import WorkloadError
from pipetune.workloads import StepHook, TrainStats, Workload

#: Trainer arguments the system config owns, set per epoch.
SYSTEM_OWNED = ("max_epochs", "precision", "accelerator", "devices")
#: The Trainer's quiet defaults under pipetune (a user's ``trainer`` arguments win):
#: pipetune keeps the checkpoints and records the metrics.
QUIET_TRAINER = {"logger": False, "enable_checkpointing": False,
                 "enable_progress_bar": False, "enable_model_summary": False,
                 "num_sanity_val_steps": 0}
_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def _lightning() -> Any:
    try:
        import pytorch_lightning as pl
    except ImportError:
        try:
            import lightning.pytorch as pl
        except ImportError:
            raise WorkloadError(
                "the Lightning integration needs PyTorch Lightning: pip install "
                "'pipetune[lightning]'") from None
    return pl


class LightningWorkload(Workload):
    """A workload whose epochs are Lightning epochs; made by :func:`lightning_workload`
    (subclass it and set the class attributes to the same effect)."""

    #: ``hparams -> LightningModule`` and ``hparams -> LightningDataModule``.
    module_factory: ClassVar[Callable[[dict[str, Any]], Any]]
    datamodule_factory: ClassVar[Callable[[dict[str, Any]], Any]]
    #: Default hyperparameters (the trial's own replace them).
    hparam_defaults: ClassVar[Mapping[str, Any]] = {}
    #: More ``Trainer`` arguments (callbacks, loggers, gradient clipping, ...).
    trainer_kwargs: ClassVar[Mapping[str, Any]] = {}
    metrics: ClassVar[tuple[str, ...]] = ("val_loss",)

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.hparams: dict[str, Any] | None = None
        self.module: Any = None
        self.datamodule: Any = None
        self._epoch = 0
        self._ckpt: str | None = None  # the trial's last Lightning checkpoint, here
        self._folder = tempfile.mkdtemp(prefix="pipetune-lightning-")
        self._fresh: dict[str, float] | None = None  # the last fit's validation metrics

    # -- Workload -----------------------------------------------------------------------
    def setup(self, hparams: Mapping[str, Any], seed: int) -> None:
        pl = _lightning()
        self.hparams = {**self.hparam_defaults, **hparams}
        pl.seed_everything(seed, verbose=False)
        self.module = type(self).module_factory(dict(self.hparams))
        self.datamodule = type(self).datamodule_factory(dict(self.hparams))
        self._epoch, self._ckpt, self._fresh = 0, None, None

    @property
    def batch_size(self) -> int:
        if self.hparams is None:
            raise WorkloadError(f"workload {self.name!r}: batch_size is known only after setup()")
        size = self.hparams.get("batch_size", getattr(self.datamodule, "batch_size", 1))
        return int(size)

    def train_epoch(self, system: Any, on_step: StepHook | None = None) -> TrainStats:
        from pipetune.system.apply import applied_context

        ctx = applied_context(system)
        if hasattr(self.datamodule, "num_workers"):
            self.datamodule.num_workers = ctx.config.dataloader_workers
        module = self.module.to(memory_format=ctx.memory_format) \
            if ctx.config.channels_last else self.module
        path = os.path.join(self._folder, "last.ckpt")
        with _quiet():
            trainer = self._trainer(ctx, max_epochs=self._epoch + 1, on_step=on_step)
            trainer.fit(ctx.training_model(module), datamodule=self.datamodule,
                        ckpt_path=self._ckpt, weights_only=False)
            trainer.save_checkpoint(path, weights_only=False)
        self._epoch = trainer.current_epoch
        self._fresh = _floats(trainer.callback_metrics)
        self._ckpt = path
        loss = self._fresh.get("train_loss", self._fresh.get("loss", float("nan")))
        return TrainStats(loss=loss, samples=_samples(trainer, self.batch_size),
                          steps=trainer.num_training_batches)

    def evaluate(self, system: Any) -> dict[str, float]:
        """The metrics the module logged in the validation of the epoch just trained;
        a model only loaded (no epoch trained here) is validated now."""
        if self._fresh is not None:
            metrics, self._fresh = self._fresh, None
            return metrics
        from pipetune.system.apply import applied_context

        with _quiet():
            trainer = self._trainer(applied_context(system), max_epochs=max(self._epoch, 1))
            trainer.validate(self.module, datamodule=self.datamodule, ckpt_path=self._ckpt,
                             verbose=False, weights_only=False)
        return _floats(trainer.callback_metrics)

    def state_dict(self) -> dict[str, Any]:
        """The trial's last Lightning checkpoint, as ``torch.load`` reads it."""
        import torch

        if self._ckpt is None:
            raise WorkloadError(f"workload {self.name!r}: no epoch trained yet, no checkpoint")
        return _plain(torch.load(self._ckpt, map_location="cpu", weights_only=False))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        import torch

        path = os.path.join(self._folder, "loaded.ckpt")
        torch.save(dict(state), path)
        self._ckpt = path
        self._epoch = int(state.get("epoch", 0))  # epochs finished when it was saved
        self.module.load_state_dict(state["state_dict"])

    def trained_model(self) -> Any:
        """The LightningModule (its weights as trained or loaded)."""
        return self.module

    # -- Lightning ---------------------------------------------------------------------
    def _trainer(self, ctx: Any, *, max_epochs: int, on_step: StepHook | None = None) -> Any:
        pl = _lightning()
        given = dict(self.trainer_kwargs)
        owned = sorted(set(given) & set(SYSTEM_OWNED))
        if owned:
            raise WorkloadError(
                f"workload {self.name!r}: trainer arguments {', '.join(owned)} are set per "
                "epoch from the system config and the study (max_epochs: the job's "
                "early_stopping.max_epochs; precision, device: the system space)")
        callbacks = list(given.pop("callbacks", None) or [])
        if on_step is not None:
            callbacks.append(_StepCallback(pl, on_step))
        kwargs = {**QUIET_TRAINER, "default_root_dir": self._folder, **given}
        return pl.Trainer(
            max_epochs=max_epochs, precision=_PRECISION.get(ctx.config.precision, "32-true"),
            accelerator="gpu" if ctx.config.device == "cuda" else "cpu", devices=1,
            callbacks=callbacks, **kwargs)


def _StepCallback(pl: Any, on_step: StepHook) -> Any:  # noqa: N802 - builds a class
    class StepCallback(pl.Callback):
        """Tells the profiler each optimiser step."""

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            on_step()

    return StepCallback()


def lightning_workload(*, module: Callable[[dict[str, Any]], Any],
                       datamodule: Callable[[dict[str, Any]], Any],
                       metrics: tuple[str, ...] | list[str] = ("val_loss",),
                       hparams: Mapping[str, Any] | None = None,
                       trainer: Mapping[str, Any] | None = None,
                       name: str | None = None) -> type[LightningWorkload]:
    """A :class:`LightningWorkload` subclass: ``module(hparams)`` builds the trial's
    LightningModule, ``datamodule(hparams)`` its LightningDataModule; ``metrics``
    (what the module logs in validation, the first the default objective);
    ``hparams`` their defaults; ``trainer`` more ``Trainer`` arguments. Put the result
    in a module-level name a job file points at, or pass it to :func:`pipetune.tune`."""
    if not callable(module) or not callable(datamodule):
        raise WorkloadError("lightning_workload: module and datamodule must be callables "
                            "taking the trial's hyperparameters (a dict)")
    if not metrics:
        raise WorkloadError("lightning_workload: metrics must name what the module logs")
    caller = sys._getframe(1).f_globals.get("__name__", __name__)
    class_name = name if name and name.isidentifier() else "lightning_workload"
    namespace = {
        "__module__": caller, "__qualname__": class_name,
        "__doc__": "A Lightning workload made by pipetune.integrations.lightning_workload.",
        "module_factory": staticmethod(module), "datamodule_factory": staticmethod(datamodule),
        "hparam_defaults": dict(hparams or {}), "trainer_kwargs": dict(trainer or {}),
        "metrics": tuple(metrics),
    }
    return type(class_name, (LightningWorkload,), namespace)


def _floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def _samples(trainer: Any, batch_size: int) -> int:
    batches = trainer.num_training_batches
    return int(batches * batch_size) if batches != float("inf") else 0


def _plain(value: Any) -> Any:
    """A Lightning checkpoint with its dict subclasses (``AttributeDict``, ...) as plain
    dicts, so ``torch.load(weights_only=True)`` reads it, as pipetune's checkpoints are."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_plain(v) for v in value)
    return value


@contextlib.contextmanager
def _quiet():
    """Lightning's INFO lines (GPU available, ...) and its advice warnings stay out of
    the worker's log, once per epoch."""
    import logging
    import warnings

    loggers = [logging.getLogger(n) for n in ("pytorch_lightning", "lightning.pytorch",
                                                "lightning_fabric", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"(pytorch_)?lightning.*")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


__all__ = ["LightningWorkload", "lightning_workload"]
