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

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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

#: An untried config with a one-time cost (``compile``), about which nothing is known
#: yet, is probed only when the trial is expected to run at least this many more epochs
#: (the probe included): one epoch to pay and measure it, two to earn it back. The
#: horizon is the scheduler's *expected* epochs (each later epoch weighted by the
#: chance of reaching it, from the rungs' promotion rates so far), not the epochs the
#: trial is sure of: under ASHA with reduction factor 2 no trial is ever sure of 3 more
#: epochs, though a third of them run to the end. A trial that goes on past a rung is
#: asked again with its new horizon.
MIN_ONE_TIME_HORIZON = 3

#: A one-time cost the trial's worker is known to pay at most this share of one of the
#: trial's epochs for (a compile of a model graph the worker compiled before: dynamo
#: reuses it) makes the knob an ordinary one: probed whenever an epoch follows the probe.
CHEAP_ONE_TIME_SHARE = 0.05

#: A config reused from the ground truth whose steady cost per sample is more than
#: this much above the trial's own default (epoch 1, one-time part excluded) did not
#: transfer: the trial drops it and probes for itself.
REUSE_MARGIN = 0.10

#: Dotted prefix used when a value of the system search space is rejected.
SPACE_FIELD = "system.space"


@dataclass(frozen=True)
class EpochObservation:
    """One finished epoch of a trial, as the tuner sees it.

    ``cost`` is per sample under the system objective: seconds (``time``) or joules
    (``energy``). Lower is better; ``inf`` or NaN (an epoch that saw no samples) loses.
    ``steady`` is the same once warm, the epoch's one-time part left out (``None``:
    not measured, ``cost`` stands in); ``one_time`` is that part for the whole epoch
    (compiling, first steps, loader start), in the objective's units; ``samples`` the
    epoch's sample count (0: unknown).
    """

    epoch: int
    phase: Phase
    system: SystemConfig
    cost: float
    steady: float | None = None
    one_time: float = 0.0
    samples: int = 0
    #: Steady wall seconds per sample, whatever the objective (None: not measured).
    wall_steady: float | None = None

    @property
    def steady_cost(self) -> float:
        return _finite_or_inf(self.cost if self.steady is None else float(self.steady))

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

    ``remember`` is the config to remember for jobs like this one: it is set on the
    first decision after a run of probes (once per trial, unless a one-time knob is
    probed later, when the horizon allows it, and changes the choice). The caller stores
    ``remember`` with ``remember_cost`` (its steady cost per sample),
    ``remember_one_time`` and ``remember_speedup`` (against the default) as a record in
    the ground truth under the trial's epoch-1 profile. ``inputs`` are the figures the
    decision weighed (epochs it projects over, costs, one-time seconds), to show why.
    """

    system: SystemConfig
    phase: Phase
    remember: SystemConfig | None
    remember_cost: float | None
    reason: str
    inputs: Mapping[str, Any] = field(default_factory=dict)
    remember_one_time: float | None = None
    remember_speedup: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase", Phase(self.phase))
        if (self.remember is None) != (self.remember_cost is None):
            raise ValueError("remember and remember_cost are set together or not at all")



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
        sure_epochs: int | None = None,
        alone_cores: int | None = None,
        expected_epochs: float | None = None,
        known_one_time: float | None = None,
        probed_elsewhere: bool = False,
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
        the same unknown price beside it.
        """
        decision = self._next_epoch(history, epochs_left=epochs_left, match=match,
                                    sure_epochs=sure_epochs, expected_epochs=expected_epochs,
                                    known_one_time=known_one_time,
                                    probed_elsewhere=probed_elsewhere)
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
    ) -> TuningDecision:
        history = _checked_history(history)
        if not isinstance(epochs_left, int) or epochs_left < 0:
            raise ValueError(f"epochs_left must be an integer >= 0, got {epochs_left!r}")
        horizon, weighed = _horizon(epochs_left, sure_epochs, expected_epochs, known_one_time)
        if not self.enabled:
            return TuningDecision(
                self.default, Phase.TRAIN, None, None, "pipetune off: default config"
            )
        if not history:
            return self._first_epoch(match)

        hit_config, why = self._usable_hit(match, history)
        if hit_config is not None:
            assert match is not None
            return self._reuse(history, hit_config, match, horizon, why, weighed,
                               known_one_time)

        later = history[1:]
        probed = [o for o in later if o.phase is Phase.PROBE]
        rejected = ({match.config, self._without_one_time(match.config)}
                    if match is not None and match.hit and match.config is not None else set())
        trained = any(o.phase is Phase.TRAIN and o.system not in rejected for o in later)
        observed = [o.system for o in history]
        untried = [c for c in self._candidates if not self._tried(c, observed)]
        cheap = self._cheap_one_time(history, known_one_time)
        if epochs_left > 0:
            fits = [c for c in untried
                    if not c.one_time_knobs() or (cheap and horizon >= 2)
                    or (horizon >= MIN_ONE_TIME_HORIZON and not probed_elsewhere)]
            if trained:  # only a one-time knob deferred for a short horizon is left
                fits = [c for c in fits if c.one_time_knobs()]
            if fits:
                nxt = self._on_best(fits[0], history)
                n = len({o.system for o in probed}) + 1
                total = n - 1 + len(untried)
                reason = f"probe {n}/{total}: {describe_change(self.default, nxt)}"
                if n == 1:
                    reason += f" ({why})"
                if nxt.one_time_knobs() and cheap and horizon < MIN_ONE_TIME_HORIZON:
                    reason += " (its one-time cost is paid on this worker already)"
                return TuningDecision(nxt, Phase.PROBE, None, None, reason, inputs=weighed)
        not_yet = self._not_yet(untried, horizon, expected_epochs is not None,
                                probed_elsewhere)

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

    def _not_yet(self, untried: Sequence[SystemConfig], horizon: float, expected: bool,
                 probed_elsewhere: bool) -> str:
        """What a decision says of the one-time knobs it left unprobed, and why."""
        deferred = [c for c in untried if c.one_time_knobs()]
        if not deferred:
            return ""
        kind = "expected" if expected else "sure"
        why_not = ("another trial is probing it now" if probed_elsewhere
                   and horizon >= MIN_ONE_TIME_HORIZON else
                   f"{_rounded(horizon)} {kind} epoch(s) < {MIN_ONE_TIME_HORIZON} to earn a "
                   "one-time cost back")
        return (f"; {', '.join(describe_change(self.default, c) for c in deferred)} "
                f"not probed: {why_not}")

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
        config = self._without_one_time(match.config)
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

    def _cheap_one_time(self, history: Sequence[EpochObservation],
                        known_one_time: float | None) -> bool:
        """Whether the worker's known one-time cost is small beside one epoch
        (:data:`CHEAP_ONE_TIME_SHARE`)."""
        if known_one_time is None or not history:
            return False
        first = history[0]
        epoch = first.steady_cost * first.samples if first.samples else math.inf
        return math.isfinite(epoch) and known_one_time <= CHEAP_ONE_TIME_SHARE * epoch

    def _reuse(self, history: list[EpochObservation], config: SystemConfig,
               match: GroundTruthMatch, horizon: float, why: str,
               weighed: Mapping[str, Any] | None = None,
               known_one_time: float | None = None) -> TuningDecision:
        """Train under the ground truth's ``config``, its one-time knobs only where they
        are earned back within ``horizon`` (expected, else sure) epochs. The trial first
        measures its own steady rate under ``config`` without them (unless it has), then
        weighs: the gain is ``horizon x samples x`` that rate ``x (1 - 1/speedup)``
        (``speedup``: what the knobs added on top, as recorded), against the one-time
        cost: what the trial's worker paid for this graph before where known
        (``known_one_time``), else the recorded one."""
        ran = {o.system for o in history}
        knobs = config.one_time_knobs()
        if not knobs or config in ran:
            under = [o for o in history if o.system == config]
            if knobs and len(under) == 1 and history[-1].system == config:
                # The reused one-time knob has run once here: record what it cost this
                # time (a warm compile cache makes it a fraction of the first), so the
                # ground truth's figures follow what trials pay now.
                one_time, speedup = self.figures(history, config)
                return TuningDecision(
                    config, Phase.TRAIN, config, under[0].steady_cost,
                    f"{why}: {describe_change(self.default, config)}; record what it cost",
                    remember_one_time=one_time, remember_speedup=speedup)
            return TuningDecision(config, Phase.TRAIN, None, None,
                                  f"{why}: {describe_change(self.default, config)}")
        without = self._without_one_time(config)
        own = [o.steady_cost for o in history if o.system == without]
        if not own:
            return TuningDecision(
                without, Phase.TRAIN, None, None,
                f"{why}: {describe_change(self.default, without)} first, to weigh "
                f"{', '.join(knobs)} against this trial's own rate")
        base_steady = sum(own) / len(own)
        samples = history[-1].samples or history[0].samples
        one_time = known_one_time if known_one_time is not None else match.one_time
        kind = "sure" if weighed is None or "expected_epochs" not in weighed else "expected"
        inputs: dict[str, Any] = {**(weighed or {f"{kind}_epochs": horizon}),
                                  "base_steady_cost": base_steady, "samples": samples,
                                  "one_time": one_time, "recorded_one_time": match.one_time,
                                  "speedup": match.speedup}
        if one_time is None or match.speedup is None or not math.isfinite(base_steady):
            pays = horizon >= MIN_ONE_TIME_HORIZON
            detail = (f"no one-time figures recorded; {_rounded(horizon)} {kind} epoch(s) "
                      f"{'>=' if pays else '<'} {MIN_ONE_TIME_HORIZON}")
        else:
            speedup = max(match.speedup, 1e-9)
            gain = horizon * samples * base_steady * (1.0 - 1.0 / speedup)
            pays = gain > one_time
            inputs["gain"] = gain
            where = "" if known_one_time is None else " on this worker"
            detail = (f"saves {gain:.3g} over {_rounded(horizon)} {kind} epoch(s) at "
                      f"{speedup:.2f}x {'>' if pays else '<='} {one_time:.3g} once{where}")
        chosen = config if pays else without
        verb = "pays" if pays else "does not pay"
        reason = (f"{why}: {describe_change(self.default, chosen)} "
                  f"({', '.join(knobs)} {verb}: {detail})")
        return TuningDecision(chosen, Phase.TRAIN, None, None, reason, inputs=inputs)

    def _without_one_time(self, config: SystemConfig) -> SystemConfig:
        """``config`` with its one-time knobs set back to the default's."""
        return config.replace(**{k: getattr(self.default, k) for k in config.one_time_knobs()})

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
        history = _checked_history(history)
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
        """``(one_time, speedup)`` of ``config`` in this trial: the one-time cost of the
        first epoch that ran it, and its speed-up over the same config without its
        one-time knobs (for a config without any: over the default), each steady cost
        per sample as this trial measured it (``None`` where it measured no base)."""
        runs = [o for o in history if o.system == config]
        if not runs or not history:
            return None, None
        steady = sum(o.steady_cost for o in runs) / len(runs)
        base_config = (self._without_one_time(config) if config.one_time_knobs()
                       else self.default)
        base_runs = [o.steady_cost for o in history if o.system == base_config]
        base = sum(base_runs) / len(base_runs) if base_runs else math.nan
        speedup = base / steady if steady > 0 and math.isfinite(base) else None
        one_time = runs[0].one_time if config != history[0].system else 0.0
        return one_time, speedup

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
    base = {"device": "cuda"} if knob in (*CUDA_KNOBS, "precision") else {}
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


def _horizon(epochs_left: int, sure_epochs: int | None, expected_epochs: float | None,
             known_one_time: float | None) -> tuple[float, dict[str, Any]]:
    """The epochs a one-time cost is weighed against (the expected ones when the
    scheduler says, else the sure ones, else all left), and the figures to show."""
    if expected_epochs is not None:
        horizon: float = max(0.0, min(float(expected_epochs), float(epochs_left)))
    else:
        horizon = epochs_left if sure_epochs is None else max(0, min(sure_epochs, epochs_left))
    weighed: dict[str, Any] = {"expected_epochs" if expected_epochs is not None
                               else "sure_epochs": _rounded(horizon)}
    if sure_epochs is not None and expected_epochs is not None:
        weighed["sure_epochs"] = sure_epochs
    if known_one_time is not None:
        weighed["worker_one_time"] = _rounded(known_one_time)
    return horizon, weighed


def _rounded(value: float) -> float | int:
    """A horizon as a decision shows it: whole epochs as an int, else 2 decimals."""
    value = float(value)
    return int(value) if value.is_integer() else round(value, 2)
