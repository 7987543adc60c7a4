"""One-time knobs (a compile) in the system tuner: the epochs a one-time cost is weighed
against, whether a known job's one-time knob pays for itself in this trial, and what a
config cost once and sped up, as the ground truth remembers it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pipetune.states import GroundTruthMatch, Phase
from pipetune.system.config import SystemConfig
from pipetune.tuner.decisions import EpochObservation, TuningDecision
from pipetune.tuner.plan import describe_change

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


def not_yet_said(default: SystemConfig, untried: Sequence[SystemConfig], horizon: float,
                 expected: bool, probed_elsewhere: bool) -> str:
    """What a decision says of the one-time knobs it left unprobed, and why."""
    deferred = [c for c in untried if c.one_time_knobs()]
    if not deferred:
        return ""
    kind = "expected" if expected else "sure"
    why_not = ("another trial is probing it now" if probed_elsewhere
               and horizon >= MIN_ONE_TIME_HORIZON else
               f"{rounded(horizon)} {kind} epoch(s) < {MIN_ONE_TIME_HORIZON} to earn a "
               "one-time cost back")
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
        pays = horizon >= MIN_ONE_TIME_HORIZON
        detail = (f"no one-time figures recorded; {rounded(horizon)} {kind} epoch(s) "
                  f"{'>=' if pays else '<'} {MIN_ONE_TIME_HORIZON}")
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
