"""The system tuner: which system config each epoch of a trial runs under.

The tuner is a *policy*, as the study flow's searcher and scheduler are: it takes what
a trial's finished epochs observed and returns a decision for the next epoch. It keeps
no state between calls, so the same history always gives the same decision; a retried
or resumed trial picks up where it was.

One trial, PipeTune-style::

    epoch 1   PROFILE  under the default config; the caller profiles it and looks the
                       profile up in the ground truth
    hit       TRAIN    under the ground truth's config for every later epoch
    miss      PROBE    one untried candidate per epoch (real training), then
              TRAIN    under the cheapest config observed, which the decision asks the
                       caller to record in the ground truth

>>> from pipetune.system.config import MachineInfo, SystemConfig
>>> tuner = SystemTuner(SystemConfig(cores=1), {"cores": [1, 2]}, machine=MachineInfo(cores=2))
>>> tuner.next_epoch([], epochs_left=3, match=None).phase
<Phase.PROFILE: 'profile'>
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipetune.errors import SpecError, SystemConfigError
from pipetune.states import GroundTruthMatch, Phase
from pipetune.system.config import CUDA_KNOBS, KNOBS, MachineInfo, SystemConfig

#: Probe plans the tuner knows.
PLANS: tuple[str, ...] = ("one_knob",)

#: How much cheaper (relative) a probed config must be than the default's epoch-1 cost
#: to replace the default. Epoch 1 carries one-time costs (allocator warm-up, first-touch
#: pages, lazy imports, data-loader start-up) that later epochs do not pay, so the
#: default's only measurement is biased high and every probe looks a little better than
#: it is. Probes are compared with each other as measured (they are all post-warm-up),
#: but the default is kept unless the best probe beats it by more than this margin, which
#: is also about the epoch-to-epoch jitter of one CPU epoch on a shared machine.
WARMUP_MARGIN = 0.05

#: Dotted prefix used when a value of the system search space is rejected.
SPACE_FIELD = "system.space"


@dataclass(frozen=True)
class EpochObservation:
    """One finished epoch of a trial, as the tuner sees it.

    ``cost`` is per sample under the system objective: seconds (``time``) or joules
    (``energy``). Lower is better; ``inf`` or NaN (an epoch that saw no samples) loses.
    """

    epoch: int
    phase: Phase
    system: SystemConfig
    cost: float

    def __post_init__(self) -> None:
        if not isinstance(self.epoch, int) or isinstance(self.epoch, bool) or self.epoch < 1:
            raise ValueError(f"epoch must be an integer >= 1 (1-based), got {self.epoch!r}")
        object.__setattr__(self, "phase", Phase(self.phase))
        if not isinstance(self.system, SystemConfig):
            raise TypeError(f"system must be a SystemConfig, got {type(self.system).__name__}")
        object.__setattr__(self, "cost", float(self.cost))


@dataclass(frozen=True)
class TuningDecision:
    """What the next epoch runs under and why.

    ``record`` is set on exactly one decision of a trial that probed: the first one
    after its last probe. The caller stores ``record`` with ``record_cost`` in the
    ground truth (under the trial's epoch-1 profile).
    """

    system: SystemConfig
    phase: Phase
    record: SystemConfig | None
    record_cost: float | None
    reason: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase", Phase(self.phase))
        if (self.record is None) != (self.record_cost is None):
            raise ValueError("record and record_cost are set together or not at all")


class SystemTuner:
    """Chooses each epoch's system config from what the trial observed so far.

    ``default`` runs the profiled first epoch (and every epoch when ``enabled`` is false,
    the hyperparameter-only V1 baseline). ``space`` maps knob names to the values the
    tuner may probe, e.g. ``{"cores": [1, 2, 4], "dataloader_workers": [0, 1]}``.

    Probe plan ``one_knob`` (the paper's): starting from the default, change one knob at
    a time to each of its other values. Knobs go in :class:`SystemConfig` field order
    (``cores``, ``interop_threads``, ``dataloader_workers``, ``device``, then the CUDA
    knobs), not in the order the space was written, so two studies of one job probe the
    same configs in the same order and their ground-truth records agree; ``cores``, the
    knob that moves CPU training time most, comes first and so survives a short trial.
    A knob's values keep the order the space lists them in: that is the user's priority
    when a trial cannot fit every probe. Values equal to the default's are skipped, as
    are candidates that are invalid in combination with the default (a CUDA-only knob
    while the default runs on the CPU) or that this machine cannot honour (more cores
    than it has, CUDA without a GPU); :attr:`dropped` says which and why. ``max_probes``
    keeps the first ``max_probes`` of what is left.

    ``epochs_left`` given to :meth:`next_epoch` counts the epochs the trial may still
    run *including* the one being decided; 0 means the trial is over. A trial with
    fewer epochs left than candidates probes what fits. When a trial ends (last epoch,
    or stopped early by the scheduler) the caller asks once more with ``epochs_left=0``:
    that decision is not run, but its ``record`` says what to store if probing finished
    without a training decision. :meth:`best_observed` answers the same question
    directly.

    Choosing the best (see :data:`WARMUP_MARGIN`): the cheapest probe replaces the
    default only if its cost is below ``(1 - warmup_margin)`` times the default's
    epoch-1 cost; otherwise the default is kept (and recorded, so similar jobs later
    skip probing too). Ties between probes go to the earlier probe.
    """

    def __init__(
        self,
        default: SystemConfig,
        space: Mapping[str, Sequence[Any]],
        *,
        enabled: bool = True,
        plan: str = "one_knob",
        max_probes: int | None = None,
        machine: MachineInfo | None = None,
        warmup_margin: float = WARMUP_MARGIN,
        max_cores: int | None = None,
    ) -> None:
        if not isinstance(default, SystemConfig):
            raise TypeError(f"default must be a SystemConfig, got {type(default).__name__}")
        if plan not in PLANS:
            raise SpecError("pipetune.probe_plan", f"must be one of {PLANS}, got {plan!r}")
        if max_probes is not None and (
            not isinstance(max_probes, int) or isinstance(max_probes, bool) or max_probes < 0
        ):
            raise SpecError("pipetune.max_probes", f"must be an integer >= 0, got {max_probes!r}")
        if not (0.0 <= warmup_margin < 1.0):
            raise SpecError("pipetune.warmup_margin", f"must be in [0, 1), got {warmup_margin!r}")
        self.default = default
        self.enabled = bool(enabled)
        self.plan = plan
        self.max_probes = max_probes
        self.warmup_margin = float(warmup_margin)
        self.machine = machine if machine is not None else MachineInfo.detect()
        #: Candidates reserving more cores than this are not probed (None: no limit).
        self.max_cores = max_cores
        default.check_machine(self.machine, where="system.default")
        self.space = _normalise_space(space)
        #: Candidates left out of the plan, as ``"knob=value: why"``.
        self.dropped: list[str] = []
        self._candidates = self._plan()

    # -- the plan ------------------------------------------------------------------
    def candidates(self) -> list[SystemConfig]:
        """The probe plan in probing order: default excluded, invalid-on-machine dropped."""
        return list(self._candidates)

    def _plan(self) -> tuple[SystemConfig, ...]:
        planned: list[SystemConfig] = []
        for knob, values in self.space.items():
            for value in values:
                if _same_value(value, getattr(self.default, knob)):
                    continue
                try:
                    candidate = self.default.replace(**{knob: value})
                    candidate.check_machine(self.machine, where=SPACE_FIELD)
                except SystemConfigError as err:
                    self.dropped.append(f"{knob}={value!r}: {err.message}")
                    continue
                if self.max_cores is not None and candidate.cores > self.max_cores:
                    self.dropped.append(
                        f"{knob}={value!r}: reserves more than {self.max_cores} core(s), "
                        "what a trial can hold while trials run side by side")
                    continue
                if candidate not in planned:
                    planned.append(candidate)
        if self.max_probes is not None:
            for extra in planned[self.max_probes :]:
                self.dropped.append(f"{describe_change(self.default, extra)}: over max_probes")
            planned = planned[: self.max_probes]
        return tuple(planned)

    # -- the policy ----------------------------------------------------------------
    def next_epoch(
        self,
        history: Sequence[EpochObservation],
        *,
        epochs_left: int,
        match: GroundTruthMatch | None,
    ) -> TuningDecision:
        """The decision for epoch ``len(history) + 1``.

        ``history`` holds every finished epoch of the trial in order (epoch 1 first).
        ``match`` is the ground truth's answer for the epoch-1 profile, passed on every
        call after epoch 1; ``None`` (no lookup could be made) counts as a miss, and so
        does a hit whose config this machine cannot run.
        """
        history = _checked_history(history)
        if not isinstance(epochs_left, int) or epochs_left < 0:
            raise ValueError(f"epochs_left must be an integer >= 0, got {epochs_left!r}")
        if not self.enabled:
            return TuningDecision(
                self.default, Phase.TRAIN, None, None, "pipetune off: default config"
            )
        if not history:
            return TuningDecision(
                self.default,
                Phase.PROFILE,
                None,
                None,
                f"profile: epoch 1 under the default ({self.default.label()})",
            )

        hit_config, why = self._usable_hit(match)
        if hit_config is not None:
            return TuningDecision(
                hit_config,
                Phase.TRAIN,
                None,
                None,
                f"{why}: {describe_change(self.default, hit_config)}",
            )

        later = history[1:]
        probed = [o for o in later if o.phase is Phase.PROBE]
        trained = any(o.phase is Phase.TRAIN for o in later)
        if not trained and epochs_left > 0:
            tried = {o.system for o in probed}
            untried = [c for c in self._candidates if c not in tried]
            if untried:
                nxt = untried[0]
                n = len(probed) + 1
                total = len(probed) + len(untried)
                reason = f"probe {n}/{total}: {describe_change(self.default, nxt)}"
                if n == 1:
                    reason += f" ({why})"
                return TuningDecision(nxt, Phase.PROBE, None, None, reason)

        best = self.best_observed(history)
        if best is None:
            return TuningDecision(
                history[0].system, Phase.TRAIN, None, None, f"{why}; nothing probed: default"
            )
        config, cost = best
        reason = (
            f"train: best of {len({o.system for o in probed}) + 1} configs observed: "
            f"{describe_change(self.default, config)} (cost {cost:.4g}, "
            f"default {history[0].cost:.4g})"
        )
        if trained or not math.isfinite(cost):
            # Recorded already (one record per trial), or nothing ran well enough to learn.
            return TuningDecision(config, Phase.TRAIN, None, None, reason)
        return TuningDecision(config, Phase.TRAIN, config, cost, reason + "; record it")

    def best_observed(
        self, history: Sequence[EpochObservation]
    ) -> tuple[SystemConfig, float] | None:
        """The config to keep (and record) with its cost, or ``None`` if nothing was probed.

        Compares the default's epoch-1 cost with the mean cost of each probed config,
        applying the warm-up margin described on the class.
        """
        history = _checked_history(history)
        if not history:
            return None
        probes: dict[SystemConfig, list[float]] = {}
        for obs in history[1:]:
            if obs.phase is Phase.PROBE:
                probes.setdefault(obs.system, []).append(_finite_or_inf(obs.cost))
        if not probes:
            return None
        # dicts keep insertion order and min() keeps the first minimum: ties go to the
        # earlier probe.
        means = {cfg: sum(c) / len(c) for cfg, c in probes.items()}
        best_cfg = min(means, key=means.__getitem__)
        base = history[0]
        base_cost = _finite_or_inf(base.cost)
        if best_cfg == base.system or means[best_cfg] < base_cost * (1.0 - self.warmup_margin):
            return best_cfg, means[best_cfg]
        return base.system, base_cost

    def _usable_hit(self, match: GroundTruthMatch | None) -> tuple[SystemConfig | None, str]:
        if match is None:
            return None, "no ground-truth lookup: miss"
        if not match.hit or match.config is None:
            return None, f"ground-truth miss: {match.reason}" if match.reason else "miss"
        try:
            match.config.check_machine(self.machine, where="groundtruth.config")
        except SystemConfigError as err:
            return None, f"ground-truth config unusable here ({err}): miss"
        return match.config, (
            f"ground-truth hit (cluster {match.cluster}, bucket {match.bucket}, "
            f"support {match.support})"
        )

    def __repr__(self) -> str:
        return (
            f"SystemTuner(default={self.default.label()!r}, enabled={self.enabled}, "
            f"plan={self.plan!r}, candidates={len(self._candidates)})"
        )


def describe_change(default: SystemConfig, config: SystemConfig) -> str:
    """The knobs where ``config`` differs from ``default``, e.g. ``cores=2``."""
    changed = [
        f"{k}={getattr(config, k)}"
        for k in KNOBS
        if not _same_value(getattr(config, k), getattr(default, k))
    ]
    return ", ".join(changed) if changed else "default"


def _normalise_space(space: Mapping[str, Sequence[Any]]) -> dict[str, tuple[Any, ...]]:
    if not isinstance(space, Mapping):
        raise SpecError(SPACE_FIELD, f"must be a mapping of knob -> values, got {space!r}")
    unknown = sorted(set(space) - set(KNOBS))
    if unknown:
        raise SpecError(f"{SPACE_FIELD}.{unknown[0]}", f"unknown knob; allowed: {', '.join(KNOBS)}")
    out: dict[str, tuple[Any, ...]] = {}
    for knob in KNOBS:
        if knob not in space:
            continue
        values = space[knob]
        field = f"{SPACE_FIELD}.{knob}"
        if isinstance(values, str | bytes) or not isinstance(values, Sequence) or not values:
            raise SpecError(field, f"must be a non-empty list of values, got {values!r}")
        kept: list[Any] = []
        for value in values:
            _check_knob_value(knob, value, field)
            if not any(_same_value(value, v) for v in kept):
                kept.append(value)
        out[knob] = tuple(kept)
    return out


def _check_knob_value(knob: str, value: Any, field: str) -> None:
    """Reject a value that is malformed on its own (not merely unusable with the default)."""
    base = {"device": "cuda"} if knob in CUDA_KNOBS else {}
    try:
        SystemConfig(**{**base, knob: value})
    except SystemConfigError as err:
        raise SpecError(field, err.message) from None


def _same_value(a: Any, b: Any) -> bool:
    # True == 1 in Python; a knob value of the wrong type is a different value.
    return type(a) is type(b) and a == b


def _finite_or_inf(cost: float) -> float:
    return cost if not math.isnan(cost) else math.inf


def _checked_history(history: Sequence[EpochObservation]) -> list[EpochObservation]:
    out = list(history)
    for i, obs in enumerate(out, start=1):
        if not isinstance(obs, EpochObservation):
            raise TypeError(f"history[{i - 1}] is a {type(obs).__name__}, not an EpochObservation")
        if obs.epoch != i:
            raise ValueError(f"history must list epochs 1..n in order; item {i} is {obs.epoch}")
    return out
