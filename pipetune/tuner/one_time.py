"""One-time knobs (a compile) in the system tuner: the epochs a one-time cost is weighed
against, what an untried one is expected to cost and save, whether a known job's
one-time knob pays for itself in this trial, and what a config cost once and sped up, as
the ground truth remembers it.

A one-time cost is weighed in the objective's units (seconds), not in epochs: a compile
costs about the same seconds whatever the epoch (13-24 s of one core on this project's
machine for a small CNN, ``benchmarks/compile_cost.py``), so it is worth one epoch of a
big job and six of a small one.

>>> from pipetune.system.config import SystemConfig
>>> first = [EpochObservation(1, "profile", SystemConfig(), cost=0.005, samples=1000)]
>>> pays, figures = unknown_one_time_pays(first, 3.0, OneTimePrice())  # 5 s epochs
>>> pays, figures["expected_saving"], figures["one_time_price"]
(False, 3.0, 20.0)
>>> unknown_one_time_pays(first, 30.0, OneTimePrice())[0]
True
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipetune.states import GroundTruthMatch, Phase
from pipetune.system.config import SystemConfig
from pipetune.tuner.decisions import EpochObservation, TuningDecision
from pipetune.tuner.plan import describe_change

#: Where the size of the trial's epochs is unknown (no sample count), an untried
#: one-time knob is probed only when the trial is expected to run at least this many
#: more epochs (the probe included): one to pay and measure it, two to earn it back.
MIN_ONE_TIME_HORIZON = 3

#: A one-time cost the trial's worker is known to pay at most this share of one of the
#: trial's epochs for (a compile of a model graph the worker compiled before: dynamo
#: reuses it) makes the knob an ordinary one: probed whenever an epoch follows the probe,
#: even beside another trial probing it.
CHEAP_ONE_TIME_SHARE = 0.05

#: What an untried one-time knob is taken to cost once, in wall seconds of the config
#: that pays it, before anything measured one: torch.compile (inductor) of a small CNN's
#: training step cost 13-24 s of one CPU core on this project's machine whatever its
#: width (``benchmarks/compile_cost.py``); compiling is CPU work on a GPU machine too.
#: What this study, then the ground truth (any job on the machine), measured replaces it.
ONE_TIME_PRICE_PRIOR_S = 20.0

#: The share of each epoch an untried one-time knob is taken to save before any was
#: measured: the most a compile saved a training step here was 22% (1-22%,
#: ``benchmarks/compile_cost.py``). What the ground truth measured replaces it.
ONE_TIME_SAVING_PRIOR = 0.2


@dataclass(frozen=True)
class OneTimePrice:
    """What an untried one-time knob is expected to cost once and save.

    ``price``: what it costs once, in wall seconds (``None``: ``prior_s``), turned into
    the objective's units by what a wall second of the config it would run on costs
    (its cores, or its watts); ``saving``: the share of each later epoch's cost it
    saves; ``source``: where the figures come from, as a decision says it.
    """

    price: float | None = None
    saving: float = ONE_TIME_SAVING_PRIOR
    source: str = "prior"
    prior_s: float = ONE_TIME_PRICE_PRIOR_S


def epoch_cost(history: Sequence[EpochObservation]) -> float | None:
    """One epoch of the trial at the best steady cost it has seen, in the objective's
    units; None where its size is unknown."""
    samples = history[-1].samples or history[0].samples
    steady = [o.steady_cost for o in history if math.isfinite(o.steady_cost)]
    return min(steady) * samples if samples and steady else None


def per_wall_second(observation: EpochObservation) -> float:
    """The objective's units a wall second of ``observation``'s config cost: its cores
    (core-seconds), 1 (seconds) or its power (joules); 1 where no wall time was
    measured."""
    wall = observation.wall_steady
    if wall and wall > 0 and math.isfinite(observation.steady_cost):
        return observation.steady_cost / wall
    return 1.0


def _best(history: Sequence[EpochObservation]) -> EpochObservation:
    """The observation of the cheapest steady cost: the config a one-time knob goes on."""
    return min(history, key=lambda o: (not math.isfinite(o.steady_cost), o.steady_cost))


def unknown_one_time_pays(history: Sequence[EpochObservation], horizon: float,
                          price: OneTimePrice, known_one_time: float | None = None,
                          reuse_epochs: float = 0.0) -> tuple[bool, dict[str, Any]]:
    """Whether probing an untried one-time knob is expected to pay within ``horizon``
    epochs (the probe included): the epochs' cost x the share it saves, against what
    it costs once (``known_one_time`` where the trial's worker paid it for this graph
    before, else ``price``); and the figures weighed. An epoch must follow the probe.

    A first payment on a worker also serves the later trials there that build the same
    graph (a compile they reuse): ``reuse_epochs``, the epochs they are expected to run
    on it, count too where the worker has not paid it yet."""
    epoch = epoch_cost(history)
    if epoch is None:
        return horizon >= MIN_ONE_TIME_HORIZON, {}
    reuse = float(reuse_epochs) if known_one_time is None else 0.0
    reuse = reuse if math.isfinite(reuse) and reuse > 0 else 0.0
    if known_one_time is not None:
        once, source = float(known_one_time), "this worker"
    else:
        wall_s = price.prior_s if price.price is None else price.price
        once, source = wall_s * per_wall_second(_best(history)), price.source
    gain = (horizon + reuse) * epoch * price.saving
    figures = {"one_time_price": round(once, 3), "expected_saving": round(gain, 3),
               "saving_share": round(price.saving, 3), "price_from": source}
    if reuse:
        figures["later_trials_epochs"] = round(reuse, 2)
    return horizon >= 2 and gain > once, figures


def over(horizon: float, kind: str, weighed: Mapping[str, Any]) -> str:
    """The epochs a saving is expected over, as a decision says them."""
    later = weighed.get("later_trials_epochs")
    return (f"{rounded(horizon)} {kind} epoch(s)"
            + (f" and {later:.3g} of later trials on this worker" if later else ""))


def weighed_horizon(epochs_left: int, sure_epochs: int | None, expected_epochs: float | None,
                    known_one_time: float | None) -> tuple[float, dict[str, Any]]:
    """The epochs a one-time cost is weighed against (the expected ones when the
    scheduler says, else the sure ones, else all left), and the figures to show."""
    if expected_epochs is not None:
        horizon: float = max(0.0, min(float(expected_epochs), float(epochs_left)))
    else:
        horizon = epochs_left if sure_epochs is None else max(0, min(sure_epochs, epochs_left))
    weighed: dict[str, Any] = {"expected_epochs" if expected_epochs is not None
                               else "sure_epochs": rounded(horizon)}
    if sure_epochs is not None and expected_epochs is not None:
        weighed["sure_epochs"] = sure_epochs
    if known_one_time is not None:
        weighed["worker_one_time"] = rounded(known_one_time)
    return horizon, weighed


def rounded(value: float) -> float | int:
    """A horizon as a decision shows it: whole epochs as an int, else 2 decimals."""
    value = float(value)
    return int(value) if value.is_integer() else round(value, 2)


def without_one_time(default: SystemConfig, config: SystemConfig) -> SystemConfig:
    """``config`` with its one-time knobs set back to the default's."""
    return config.replace(**{k: getattr(default, k) for k in config.one_time_knobs()})


def cheap_one_time(history: Sequence[EpochObservation],
                   known_one_time: float | None) -> bool:
    """Whether the worker's known one-time cost is small beside one epoch
    (:data:`CHEAP_ONE_TIME_SHARE`)."""
    if known_one_time is None or not history:
        return False
    first = history[0]
    epoch = first.steady_cost * first.samples if first.samples else math.inf
    return math.isfinite(epoch) and known_one_time <= CHEAP_ONE_TIME_SHARE * epoch


def probe_said(config: SystemConfig, cheap: bool, weighed: Mapping[str, Any], horizon: float,
               expected: bool) -> str:
    """What a probe of ``config`` says of its one-time knobs: paid on this worker
    already (``cheap``), or the figures that made it pay (``weighed``)."""
    if not config.one_time_knobs():
        return ""
    if cheap:
        return " (its one-time cost is paid on this worker already)"
    if "one_time_price" not in weighed:
        return ""
    kind = "expected" if expected else "sure"
    return (f" (saves ~{weighed['expected_saving']:.3g} over {over(horizon, kind, weighed)} > "
            f"{weighed['one_time_price']:.3g} once, {weighed['price_from']})")


def not_yet_said(default: SystemConfig, untried: Sequence[SystemConfig], horizon: float,
                 expected: bool, probed_elsewhere: bool,
                 weighed: Mapping[str, Any] | None = None, pays: bool = False) -> str:
    """What a decision says of the one-time knobs it left unprobed, and why
    (``weighed``, ``pays``: what :func:`unknown_one_time_pays` weighed and answered)."""
    deferred = [c for c in untried if c.one_time_knobs()]
    if not deferred:
        return ""
    kind = "expected" if expected else "sure"
    weighed = weighed or {}
    if "one_time_price" in weighed and horizon >= 2:
        why_not = (f"saves ~{weighed['expected_saving']:.3g} over {over(horizon, kind, weighed)}"
                   f" at {weighed['saving_share']:.0%} <= {weighed['one_time_price']:.3g}"
                   f" once ({weighed['price_from']})")
        if probed_elsewhere and pays:
            why_not = "another trial is probing it now"
    elif probed_elsewhere and horizon >= MIN_ONE_TIME_HORIZON:
        why_not = "another trial is probing it now"
    else:
        need = 2 if "one_time_price" in weighed else MIN_ONE_TIME_HORIZON
        why_not = (f"{rounded(horizon)} {kind} epoch(s) < {need} to earn a one-time cost "
                   "back")
    return (f"; {', '.join(describe_change(default, c) for c in deferred)} "
            f"not probed: {why_not}")


def figures(default: SystemConfig, history: Sequence[EpochObservation],
            config: SystemConfig) -> tuple[float | None, float | None]:
    """``(one_time, speedup)`` of ``config`` in this trial: the one-time cost of the
    first epoch that ran it, and its speed-up over the same config without its
    one-time knobs (for a config without any: over the default), each steady cost
    per sample as this trial measured it (``None`` where it measured no base)."""
    runs = [o for o in history if o.system == config]
    if not runs or not history:
        return None, None
    steady = sum(o.steady_cost for o in runs) / len(runs)
    base_config = (without_one_time(default, config) if config.one_time_knobs()
                   else default)
    base_runs = [o.steady_cost for o in history if o.system == base_config]
    base = sum(base_runs) / len(base_runs) if base_runs else math.nan
    speedup = base / steady if steady > 0 and math.isfinite(base) else None
    one_time = runs[0].one_time if config != history[0].system else 0.0
    return one_time, speedup


def weigh_reuse(default: SystemConfig, history: list[EpochObservation], config: SystemConfig,
                match: GroundTruthMatch, horizon: float, why: str,
                weighed: Mapping[str, Any] | None = None,
                known_one_time: float | None = None,
                price: OneTimePrice | None = None,
                reuse_epochs: float = 0.0) -> TuningDecision:
    """Train under the ground truth's ``config``, its one-time knobs only where they
    are earned back within ``horizon`` (expected, else sure) epochs. The trial first
    measures its own steady rate under ``config`` without them (unless it has), then
    weighs: the gain is ``horizon x samples x`` that rate ``x (1 - 1/speedup)``
    (``speedup``: what the knobs added on top, as recorded), against the one-time
    cost: what the trial's worker paid for this graph before where known
    (``known_one_time``), else the recorded one; a record without those figures is
    weighed as an untried knob (``price``, see :func:`unknown_one_time_pays`)."""
    ran = {o.system for o in history}
    knobs = config.one_time_knobs()
    if not knobs or config in ran:
        under = [o for o in history if o.system == config]
        if knobs and len(under) == 1 and history[-1].system == config:
            # The reused one-time knob has run once here: record what it cost this
            # time (a warm compile cache makes it a fraction of the first), so the
            # ground truth's figures follow what trials pay now.
            one_time, speedup = figures(default, history, config)
            return TuningDecision(
                config, Phase.TRAIN, config, under[0].steady_cost,
                f"{why}: {describe_change(default, config)}; record what it cost",
                remember_one_time=one_time, remember_speedup=speedup)
        return TuningDecision(config, Phase.TRAIN, None, None,
                              f"{why}: {describe_change(default, config)}")
    without = without_one_time(default, config)
    own = [o.steady_cost for o in history if o.system == without]
    if not own:
        return TuningDecision(
            without, Phase.TRAIN, None, None,
            f"{why}: {describe_change(default, without)} first, to weigh "
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
        pays, unknown = unknown_one_time_pays(history, horizon, price or OneTimePrice(),
                                              known_one_time, reuse_epochs)
        inputs.update(unknown)
        detail = (f"no one-time figures recorded; {rounded(horizon)} {kind} epoch(s) "
                  f"{'>=' if pays else '<'} {MIN_ONE_TIME_HORIZON}" if not unknown else
                  f"no one-time figures recorded; saves ~{unknown['expected_saving']:.3g} "
                  f"over {over(horizon, kind, unknown)} {'>' if pays else '<='} "
                  f"{unknown['one_time_price']:.3g} once ({unknown['price_from']})")
    else:
        speedup = max(match.speedup, 1e-9)
        gain = horizon * samples * base_steady * (1.0 - 1.0 / speedup)
        pays = gain > one_time
        inputs["gain"] = gain
        where = "" if known_one_time is None else " on this worker"
        detail = (f"saves {gain:.3g} over {rounded(horizon)} {kind} epoch(s) at "
                  f"{speedup:.2f}x {'>' if pays else '<='} {one_time:.3g} once{where}")
    chosen = config if pays else without
    verb = "pays" if pays else "does not pay"
    reason = (f"{why}: {describe_change(default, chosen)} "
              f"({', '.join(knobs)} {verb}: {detail})")
    return TuningDecision(chosen, Phase.TRAIN, None, None, reason, inputs=inputs)
