"""The system tuner's policy: which system config each epoch of a trial runs under, from
what the trial's finished epochs observed (see :mod:`pipetune.tuner`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pipetune.errors import SpecError, SystemConfigError
from pipetune.states import GroundTruthMatch, Phase
from pipetune.system.config import MachineInfo, SystemConfig
from pipetune.tuner.decisions import EpochObservation, TuningDecision, checked_history
from pipetune.tuner.one_time import (
    OneTimePrice,
    cheap_one_time,
    figures,
    not_yet_said,
    probe_said,
    unknown_one_time_pays,
    weigh_reuse,
    weighed_horizon,
    without_one_time,
)
from pipetune.tuner.plan import PLANS, describe_change, normalise_space, probe_plan

#: How much cheaper (relative) a probed config must be than the default's epoch-1 cost
#: to replace the default. Epoch 1 carries one-time costs (allocator warm-up, first-touch
#: pages, lazy imports, data-loader start-up) that later epochs do not pay, so the
#: default's only measurement is biased high and every probe looks a little better than
#: it is. Probes are compared with each other as measured (they are all post-warm-up),
#: but the default is kept unless the best probe beats it by more than this margin, which
#: is also about the epoch-to-epoch jitter of one CPU epoch on a shared machine.
WARMUP_MARGIN = 0.05

#: A config reused from the ground truth whose steady cost per sample is more than
#: this much above the trial's own default (epoch 1, one-time part excluded) did not
#: transfer: the trial drops it and probes for itself.
REUSE_MARGIN = 0.10


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
    that decision is not run, but its ``remember`` says what to store if probing finished
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
        self.space = normalise_space(space)
        #: Candidates left out of the plan, as ``"knob=value: why"``.
        self._candidates, self.dropped = probe_plan(
            default, self.space, self.machine, max_cores=max_cores, max_probes=max_probes)

    # -- the plan ------------------------------------------------------------------
    def candidates(self) -> list[SystemConfig]:
        """The probe plan in probing order: default excluded, invalid-on-machine dropped."""
        return list(self._candidates)

    def next_epoch(
        self,
        history: Sequence[EpochObservation],
        *,
        epochs_left: int,
        match: GroundTruthMatch | None,
        sure_epochs: int | None = None,
        alone_cores: int | None = None,
        expected_epochs: float | None = None,
        known_one_time: float | None = None,
        probed_elsewhere: bool = False,
        one_time_price: OneTimePrice | None = None,
        reuse_epochs: float = 0.0,
    ) -> TuningDecision:
        """The decision for epoch ``len(history) + 1``.

        ``alone_cores``: the trial runs alone and no trial waits for cores (the tail of
        an ASHA study, fewer trials than slots), so this many cores would otherwise sit
        idle. A training epoch then takes them if the trial's own wall-clock
        measurements say it goes faster: one probe under the wider config, kept only if
        its steady seconds per sample beat the narrow one's by the margin. Judged by
        wall time, not core-seconds, and never recorded: it is the situation's choice.

        ``history`` holds every finished epoch of the trial in order (epoch 1 first).
        ``match`` is the ground truth's answer for the epoch-1 profile, passed on every
        call after epoch 1; ``None`` (no lookup could be made) counts as a miss, and so
        does a hit whose config this machine cannot run. ``sure_epochs`` is how many
        epochs the trial will run for certain, this one included (the scheduler's next
        rung, see :meth:`~pipetune.schedulers.Scheduler.sure_epochs`).
        ``expected_epochs`` is how many it is expected to run, this one included
        (:meth:`~pipetune.schedulers.Scheduler.expected_epochs`): a one-time cost is
        weighed against it when given, else against ``sure_epochs``, else
        ``epochs_left``. ``known_one_time`` is what the one-time knobs cost on the
        worker that runs the trial's next epoch, where that worker paid them for this
        model graph before (about nothing: a compile it reuses), in the objective's
        units for the whole epoch; ``None``: not known, the recorded or unknown figure
        stands. ``probed_elsewhere``: another trial of the study is probing an unknown
        one-time knob right now; this one waits for what it will measure rather than pay
        the same unknown price beside it. ``one_time_price``: what an untried one-time
        knob is expected to cost once and save (what the study or the ground truth
        measured; ``None``: the priors of :mod:`pipetune.tuner.one_time`). It is probed
        when the expected epochs x the trial's epoch cost x that saving is more than that
        price (or than ``known_one_time``), in the objective's units: seconds, not epochs.
        ``reuse_epochs``: the epochs later trials are expected to run on this trial's
        worker reusing what it pays once (the same model graph), which a first payment
        there saves too.
        """
        decision = self._next_epoch(history, epochs_left=epochs_left, match=match,
                                    sure_epochs=sure_epochs, expected_epochs=expected_epochs,
                                    known_one_time=known_one_time,
                                    probed_elsewhere=probed_elsewhere,
                                    one_time_price=one_time_price, reuse_epochs=reuse_epochs)
        if (alone_cores is None or decision.phase is not Phase.TRAIN or not self.enabled
                or alone_cores <= decision.system.cores or epochs_left <= 0):
            return decision
        return self._take_idle_cores(history, decision, alone_cores, epochs_left)

    def _take_idle_cores(self, history: Sequence[EpochObservation], decision: TuningDecision,
                         cores: int, epochs_left: int) -> TuningDecision:
        narrow = decision.system
        wide = narrow.replace(cores=cores)
        try:
            wide.check_machine(self.machine)
        except SystemConfigError:
            return decision

        def wall(config: SystemConfig) -> float | None:
            runs = [o.wall_steady for o in history if o.system == config
                    and o.wall_steady is not None and o.epoch > 1]
            runs = runs or [o.wall_steady for o in history
                            if o.system == config and o.wall_steady is not None]
            return sum(runs) / len(runs) if runs else None

        wide_s, narrow_s = wall(wide), wall(narrow)
        if wide_s is None and epochs_left < 2:
            return decision  # a probe now could not pay: no epoch would follow it
        if wide_s is None:
            # Training, measured: not a probe of the plan, so never chosen by
            # best_observed or remembered (``remember``, if any, stays the narrow config's).
            return dataclasses.replace(
                decision, system=wide,
                reason=f"{decision.reason}; alone with {cores - narrow.cores} idle core(s): "
                       f"try cores={cores}")
        if narrow_s is not None and wide_s < narrow_s * (1.0 - self.warmup_margin):
            return dataclasses.replace(
                decision, system=wide,
                reason=f"{decision.reason}; alone: cores={cores} ({wide_s:.3g} s/sample "
                       f"against {narrow_s:.3g})")
        return decision

    def _next_epoch(
        self,
        history: Sequence[EpochObservation],
        *,
        epochs_left: int,
        match: GroundTruthMatch | None,
        sure_epochs: int | None = None,
        expected_epochs: float | None = None,
        known_one_time: float | None = None,
        probed_elsewhere: bool = False,
        one_time_price: OneTimePrice | None = None,
        reuse_epochs: float = 0.0,
    ) -> TuningDecision:
        history = checked_history(history)
        price = one_time_price or OneTimePrice()
        if not isinstance(epochs_left, int) or epochs_left < 0:
            raise ValueError(f"epochs_left must be an integer >= 0, got {epochs_left!r}")
        horizon, weighed = weighed_horizon(epochs_left, sure_epochs, expected_epochs,
                                           known_one_time)
        if not self.enabled:
            return TuningDecision(
                self.default, Phase.TRAIN, None, None, "pipetune off: default config"
            )
        if not history:
            return self._first_epoch(match)

        hit_config, why = self._usable_hit(match, history)
        if hit_config is not None:
            assert match is not None
            return weigh_reuse(self.default, history, hit_config, match, horizon, why,
                               weighed, known_one_time, price, reuse_epochs)

        later = history[1:]
        probed = [o for o in later if o.phase is Phase.PROBE]
        rejected = ({match.config, without_one_time(self.default, match.config)}
                    if match is not None and match.hit and match.config is not None else set())
        trained = any(o.phase is Phase.TRAIN and o.system not in rejected for o in later)
        observed = [o.system for o in history]
        untried = [c for c in self._candidates if not self._tried(c, observed)]
        cheap = cheap_one_time(history, known_one_time)
        pays, once = (unknown_one_time_pays(history, horizon, price, known_one_time, reuse_epochs)
                      if any(c.one_time_knobs() for c in untried) else (False, {}))
        weighed = {**weighed, **once}
        if epochs_left > 0:
            fits = [c for c in untried if not c.one_time_knobs()
                    or (cheap and horizon >= 2) or (pays and not probed_elsewhere)]
            if trained:  # only a one-time knob deferred for a short horizon is left
                fits = [c for c in fits if c.one_time_knobs()]
            if fits:
                nxt = self._on_best(fits[0], history)
                n = len({o.system for o in probed}) + 1
                total = n - 1 + len(untried)
                reason = f"probe {n}/{total}: {describe_change(self.default, nxt)}"
                if n == 1:
                    reason += f" ({why})"
                reason += probe_said(nxt, cheap, once, horizon, expected_epochs is not None)
                return TuningDecision(nxt, Phase.PROBE, None, None, reason, inputs=weighed)
        not_yet = not_yet_said(self.default, untried, horizon, expected_epochs is not None,
                                probed_elsewhere, once, pays)

        best = self.best_observed(history)
        if best is None:
            return TuningDecision(
                history[0].system, Phase.TRAIN, None, None,
                f"{why}; nothing probed: default{not_yet}", inputs=weighed,
            )
        config, cost = best
        reason = (
            f"train: best of {len({o.system for o in probed}) + 1} configs observed: "
            f"{describe_change(self.default, config)} (steady cost {cost:.4g}, "
            f"default {history[0].steady_cost:.4g}){not_yet}"
        )
        inputs = {**weighed, "steady_cost": cost,
                  "default_steady_cost": history[0].steady_cost}
        if history[-1].phase is not Phase.PROBE or not math.isfinite(cost):
            # Recorded after the probes already, or nothing ran well enough to learn.
            return TuningDecision(config, Phase.TRAIN, None, None, reason, inputs=inputs)
        one_time, speedup = self.figures(history, config)
        return TuningDecision(config, Phase.TRAIN, config, cost, reason + "; record it",
                              inputs=inputs, remember_one_time=one_time, remember_speedup=speedup)

    def _first_epoch(self, match: GroundTruthMatch | None) -> TuningDecision:
        """Epoch 1, profiled: under a known job's config when the ground truth knows the
        job already (its one-time knobs left for later), else under the default."""
        known = self._known_first(match)
        if known is None:
            return TuningDecision(self.default, Phase.PROFILE, None, None,
                                  f"profile: epoch 1 under the default ({self.default.label()})")
        assert match is not None
        return TuningDecision(
            known, Phase.PROFILE, None, None,
            f"profile: epoch 1 under the {match.reason} (confirmed by this epoch; "
            f"{', '.join(match.config.one_time_knobs()) or 'no one-time knob'} "
            "left for later)" if known != match.config else
            f"profile: epoch 1 under the {match.reason} (confirmed by this epoch)")

    def _known_first(self, match: GroundTruthMatch | None) -> SystemConfig | None:
        """The config a known job's first epoch runs under: the known config without its
        one-time knobs (ASHA may stop the trial after this epoch; the knob is weighed
        once the trial's sure epochs are known), if this machine can run it."""
        if match is None or not match.hit or match.known_graph is None or match.config is None:
            return None
        config = without_one_time(self.default, match.config)
        try:
            config.check_machine(self.machine)
        except SystemConfigError:
            return None
        return None if config == self.default else config

    @staticmethod
    def _tried(candidate: SystemConfig, observed: Sequence[SystemConfig]) -> bool:
        """Whether ``candidate`` ran: itself, or for a one-time knob that knob's value on
        top of whatever config (see :meth:`_on_best`)."""
        knobs = candidate.one_time_knobs()
        if not knobs:
            return candidate in observed
        return any(all(getattr(o, k) == getattr(candidate, k) for k in knobs)
                   for o in observed)

    def _on_best(self, candidate: SystemConfig,
                 history: Sequence[EpochObservation]) -> SystemConfig:
        """A one-time knob is probed on top of the best config observed so far (a
        compile of the config the trial would keep, not of the default); any other
        candidate as planned. One-time knobs come last in the plan (field order), so
        the others have been probed by then."""
        knobs = candidate.one_time_knobs()
        if not knobs:
            return candidate
        best = self.best_observed(history)
        base = best[0] if best is not None else history[0].system
        on_top = base.replace(**{k: getattr(candidate, k) for k in knobs})
        try:
            on_top.check_machine(self.machine)
        except SystemConfigError:
            return candidate
        return on_top

    def best_observed(
        self, history: Sequence[EpochObservation]
    ) -> tuple[SystemConfig, float] | None:
        """The config to keep (and record) with its steady cost, or ``None`` if nothing
        was probed.

        Compares the default's epoch-1 steady cost with the mean steady cost of each
        probed config (every one of them has paid its one-time cost in this trial
        already: from here on only the steady rate counts), applying the margin
        described on the class.
        """
        history = checked_history(history)
        if not history:
            return None
        probes: dict[SystemConfig, list[float]] = {}
        for obs in history[1:]:
            if obs.phase is Phase.PROBE:
                probes.setdefault(obs.system, []).append(obs.steady_cost)
        if not probes:
            return None
        # dicts keep insertion order and min() keeps the first minimum: ties go to the
        # earlier probe.
        means = {cfg: sum(c) / len(c) for cfg, c in probes.items()}
        best_cfg = min(means, key=means.__getitem__)
        base = history[0]
        base_cost = base.steady_cost
        if best_cfg == base.system or means[best_cfg] < base_cost * (1.0 - self.warmup_margin):
            return best_cfg, means[best_cfg]
        return base.system, base_cost

    def figures(self, history: Sequence[EpochObservation],
                config: SystemConfig) -> tuple[float | None, float | None]:
        """``(one_time, speedup)`` of ``config`` in this trial
        (:func:`~pipetune.tuner.one_time.figures`)."""
        return figures(self.default, history, config)

    def _usable_hit(self, match: GroundTruthMatch | None,
                    history: Sequence[EpochObservation] = ()) -> tuple[SystemConfig | None, str]:
        if match is None:
            return None, "no ground-truth lookup: miss"
        if not match.hit or match.config is None:
            return None, f"ground-truth miss: {match.reason}" if match.reason else "miss"
        try:
            match.config.check_machine(self.machine, where="groundtruth.config")
        except SystemConfigError as err:
            return None, f"ground-truth config unusable here ({err}): miss"
        # Reuse is checked, never trusted: a config that ran slower here than this
        # trial's own default did not transfer (a similar profile, another model).
        base = history[0].steady_cost if history else math.inf
        reused = [o for o in history[1:] if o.system == match.config and o.phase is Phase.TRAIN]
        if reused and math.isfinite(base) and reused[0].system != history[0].system:
            steady = sum(o.steady_cost for o in reused) / len(reused)
            if steady > base * (1.0 + REUSE_MARGIN):
                return None, (f"ground-truth config {match.config.label()} ran "
                              f"{steady / base:.2f}x this trial's default: miss, probing")
        if match.known_graph is not None:
            return match.config, f"known job (support {match.support})"
        return match.config, (
            f"ground-truth hit (cluster {match.cluster}, bucket {match.bucket}, "
            f"support {match.support})"
        )

    def __repr__(self) -> str:
        return (
            f"SystemTuner(default={self.default.label()!r}, enabled={self.enabled}, "
            f"plan={self.plan!r}, candidates={len(self._candidates)})"
        )
