"""The epoch profiler: measure one training epoch and turn it into a :class:`Profile`."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipetune.errors import SpecError
from pipetune.profiler import usage as _usage
from pipetune.profiler.energy import EnergyMeter, EstimateMeter, best_meter, cuda_index
from pipetune.profiler.opmix import OP_CATEGORIES, OpMix, OpMixRecorder
from pipetune.profiler.perf import PerfSession, perf_support
from pipetune.profiler.perf_events import KernelCounters, kernel_support
from pipetune.profiler.profile import PROFILE_FEATURES, EpochMeasurement, Profile

if TYPE_CHECKING:
    from pipetune.workloads._base import StepHook, TrainStats

PERF_MODES: tuple[str, ...] = ("auto", "off")
#: Steps left alone at the start of an epoch before the op mix is traced.
SKIP_STEPS = 2


class _StepClock:
    """The step hook handed to the workload: times steps and drives the op-mix trace."""

    __slots__ = ("recorder", "durations", "hook_s", "_last")

    def __init__(self, recorder: OpMixRecorder | None) -> None:
        self.recorder = recorder
        self.durations: list[float] = []  # each step's time, the hook's own time excluded
        self.hook_s = 0.0
        self._last = time.perf_counter()

    def restart(self) -> None:
        self._last = time.perf_counter()

    def __call__(self) -> None:
        now = time.perf_counter()
        self.durations.append(now - self._last)
        if self.recorder is not None and self.recorder.running:
            self.recorder.step()
            end = time.perf_counter()
            self.hook_s += end - now
            self._last = end
        else:
            self._last = now


class EpochProfiler:
    """Measures one training epoch: time, CPU, memory, OS counters, energy, op mix.

    ``measure(train)`` runs ``train(on_step)`` once and returns its
    :class:`~pipetune.workloads.TrainStats` with an
    :class:`~pipetune.profiler.EpochMeasurement` whose ``profile`` holds every name in
    :data:`~pipetune.profiler.PROFILE_FEATURES`.

    * Time: wall seconds of ``train``; CPU seconds (user + system) of this process's
      threads and of its child processes (DataLoader workers), see
      :mod:`pipetune.profiler.usage`; ``cpu_util`` = CPU s / wall s / usable cores.
    * Memory: peak RSS of this process during the epoch (the peak mark is reset first).
    * Counters: context switches and page faults (minor + major) from ``getrusage`` and
      ``/proc``, always; with ``perf="auto"`` also ``perf stat`` events when perf works
      here (``counters_source`` ``perf:hardware`` or ``perf:software``, else ``psutil``).
    * Energy: ``energy_meter``, or :func:`~pipetune.profiler.best_meter` for ``device``.
    * Op mix: with ``profile_ops``, ``torch.profiler`` traces ``op_mix_steps`` steps
      after the first two, see :mod:`pipetune.profiler.opmix`.

    ``overhead_s`` is the profiler's own time: set-up and read-out around the epoch
    (measured), time in the step hook (measured, includes starting and stopping the
    trace), and what recording added to the traced steps (estimated from their median
    against the untraced steps' median). ``wall_s`` includes the part of it spent
    inside the epoch; set-up and read-out lie outside ``wall_s``.

    >>> profiler = EpochProfiler(perf="off")
    >>> stats, m = profiler.measure(lambda hook: workload.train_epoch(system, on_step=hook))
    ... # doctest: +SKIP
    """

    def __init__(self, *, op_mix_steps: int = 10, perf: str = "auto",
                 watts_per_core: float = 10.0, energy_meter: EnergyMeter | None = None,
                 device: str = "cpu") -> None:
        if isinstance(op_mix_steps, bool) or not isinstance(op_mix_steps, int) \
                or op_mix_steps < 1:
            raise SpecError("profiler.op_mix_steps",
                            f"must be an integer >= 1, got {op_mix_steps!r}")
        if perf not in PERF_MODES:
            raise SpecError("profiler.perf", f"must be one of {PERF_MODES}, got {perf!r}")
        if isinstance(watts_per_core, bool) or not isinstance(watts_per_core, int | float) \
                or not watts_per_core > 0:
            raise SpecError("profiler.watts_per_core",
                            f"must be a number > 0, got {watts_per_core!r}")
        if energy_meter is not None and not isinstance(energy_meter, EnergyMeter):
            raise SpecError("profiler.energy_meter",
                            f"must be an EnergyMeter, got {type(energy_meter).__name__}")
        cuda_index(device)  # validates the device string
        self.op_mix_steps = op_mix_steps
        self.perf = perf
        self.watts_per_core = float(watts_per_core)
        self.device = device
        self._meter = energy_meter

    @property
    def energy_meter(self) -> EnergyMeter:
        """The meter in use; chosen by :func:`best_meter` on first use when not given."""
        if self._meter is None:
            self._meter = best_meter(self.device, self.watts_per_core)
        return self._meter

    def measure(self, train: Callable[[StepHook | None], TrainStats], *,
                profile_ops: bool = True) -> tuple[TrainStats, EpochMeasurement]:
        """Run ``train(on_step)`` once and measure it. Exceptions from ``train``
        propagate after the profiler has cleaned up (perf stopped, trace closed)."""
        t_setup = time.perf_counter()
        meter = self.energy_meter
        # The plain estimate is CPU seconds x watts: computed from cpu_s below, sparing
        # two more process-tree reads.
        run_meter = not (type(meter) is EstimateMeter and meter.reads_process_cpu)
        session = _perf_session(self.perf)
        recorder = OpMixRecorder(self.op_mix_steps, SKIP_STEPS, self.device) \
            if profile_ops else None
        meter_on = False
        try:
            if session is not None and not session.start():
                session = None
            # perf is our child but not part of the training: keep its usage out.
            exclude = frozenset({session.perf_pid} if session and session.perf_pid else ())
            if recorder is not None:
                recorder.start()
            clock = _StepClock(recorder)
            rss_start = _usage.current_rss_mb()
            peak_reset = _usage.reset_peak_rss()
            if run_meter:
                meter.start()
                meter_on = True
            before = _usage.snapshot(exclude)
            wait_before = _usage.thread_cpu_wait_s()
            setup_s = time.perf_counter() - t_setup

            clock.restart()
            t0 = time.perf_counter()
            stats = train(clock)
        except BaseException:
            _abandon(recorder, session, meter if meter_on else None)
            raise
        wall_s = time.perf_counter() - t0
        wait_after = _usage.thread_cpu_wait_s()

        t_read = time.perf_counter()
        after = _usage.snapshot(exclude)
        if session is not None:
            session.interrupt()  # perf prints and exits while the rest is read
        used = _usage.usage_between(before, after)
        energy_j = meter.stop() if run_meter else meter.joules_for(used.cpu_s)
        peak_mb = _usage.peak_rss_mb()
        if not peak_reset:
            peak_mb = max(rss_start, _usage.current_rss_mb())
        op_mix = recorder.finish() if recorder is not None else OpMix(
            dict.fromkeys(OP_CATEGORIES, 0.0), 0, "off")
        perf_counts = session.stop() if session is not None else None
        readout_s = time.perf_counter() - t_read

        counters, counters_source = _counters(used, perf_counts,
                                              session.level if session else None)
        in_epoch_s = clock.hook_s + _traced_excess(clock, recorder)
        steady_step_s, one_time_s, cpu_wait_s = _time_split(
            clock, recorder, wall_s, in_epoch_s, wait_before, wait_after)
        overhead_s = setup_s + readout_s + in_epoch_s
        cpu_util = used.cpu_s / wall_s / _usable_cores() if wall_s > 0 else 0.0
        steps = stats.steps
        samples = stats.samples
        profile = _profile(op_mix, used, wall_s, steps, samples, peak_mb, cpu_util,
                           {"counters": counters_source, "energy": meter.source,
                            "op_mix": op_mix.source})
        measurement = EpochMeasurement(
            wall_s=wall_s, samples=samples, steps=steps, cpu_s=used.cpu_s, cpu_util=cpu_util,
            peak_rss_mb=peak_mb, ctx_switches=used.ctx_switches, page_faults=used.page_faults,
            energy_j=energy_j, energy_source=meter.source, counters_source=counters_source,
            op_mix=dict(op_mix.shares), counters=counters, overhead_s=overhead_s,
            profile=profile, overhead_in_epoch_s=in_epoch_s,
            one_time_s=one_time_s, steady_step_s=steady_step_s, cpu_wait_s=cpu_wait_s,
        )
        return stats, measurement


def _perf_session(perf: str) -> PerfSession | KernelCounters | None:
    """What counts the epoch's perf events: the kernel's counters on this process's
    threads where it gives them (:mod:`pipetune.profiler.perf_events`), else a ``perf
    stat`` process; None with ``perf: off`` or neither."""
    if perf != "auto":
        return None
    kernel = kernel_support()
    if kernel is not None:
        return KernelCounters(os.getpid(), kernel)
    level = perf_support()
    return PerfSession(os.getpid(), level) if level else None


def _abandon(recorder: OpMixRecorder | None, session: PerfSession | KernelCounters | None,
             meter: EnergyMeter | None) -> None:
    """Release what a failed measurement started; the training error is the one to report."""
    if recorder is not None:
        try:
            recorder.finish()
        except Exception:  # noqa: BLE001
            pass
    if session is not None:
        session.kill()
    if meter is not None:
        try:
            meter.stop()
        except Exception:  # noqa: BLE001
            pass


def _traced_excess(clock: _StepClock, recorder: OpMixRecorder | None) -> float:
    """Seconds tracing added to the traced steps: their count times how much their
    median step exceeds the median untraced step (0 without a baseline).

    Medians, so one step stretched by another process does not count as overhead.
    Step 0 (start-up, the loader spinning up) is left out of the baseline.
    """
    if recorder is None:
        return 0.0
    first, last = recorder.first_traced_step, recorder.last_traced_step
    durations = clock.durations
    traced = [d for i, d in enumerate(durations) if first <= i <= last]
    baseline = [d for i, d in enumerate(durations) if i > 0 and not first <= i <= last]
    if not traced or not baseline:
        return 0.0
    return len(traced) * max(0.0, statistics.median(traced) - statistics.median(baseline))


#: Steps at the start of an epoch that never count towards its steady rate (the loader
#: starting, the first step allocating, compiling).
WARMUP_STEPS = 2
#: A step slower than this many times the median is a one-time event (a recompile for
#: a new batch shape, a loader worker starting late), not part of the steady rate.
OUTLIER_FACTOR = 2.5
#: ... as long as such steps are rare: at most 2, or this share of the steps.
RARE_SHARE = 0.02


def _counters(used: Any, perf_counts: Any, level: str | None) -> tuple[dict[str, float], str]:
    """The epoch's OS counters (and ``perf``'s, when it ran), and where they came from."""
    counters = {
        "cpu_s": used.cpu_s,
        "ctx_switches_voluntary": float(used.ctx_voluntary),
        "ctx_switches_involuntary": float(used.ctx_involuntary),
        "page_faults_minor": float(used.minor_faults),
        "page_faults_major": float(used.major_faults),
    }
    if perf_counts is None:
        return counters, "psutil"
    counters.update({f"perf:{k}": v for k, v in perf_counts.values.items()})
    return counters, f"perf:{level}"


def _time_split(clock: _StepClock, recorder: OpMixRecorder | None, wall_s: float,
                in_epoch_s: float, wait_before: float | None,
                wait_after: float | None) -> tuple[float, float, float]:
    """``(steady_step_s, one_time_s, cpu_wait_s)`` of an epoch of ``wall_s`` of which the
    profiler took ``in_epoch_s``, its thread's CPU wait read before and after."""
    steady_step_s, one_time_s = _split_one_time(clock, recorder, wall_s - in_epoch_s)
    own_s = max(wall_s - in_epoch_s, 0.0)
    if wait_before is None or wait_after is None or own_s <= 0:
        return steady_step_s, one_time_s, 0.0
    cpu_wait_s = min(max(wait_after - wait_before, 0.0), own_s)
    # Every step waited alike, as far as we can tell: the steady step and the one-time
    # part are what they would have been on a CPU of its own.
    share = 1.0 - cpu_wait_s / own_s
    return steady_step_s * share, one_time_s * share, cpu_wait_s


def _profile(op_mix: OpMix, used: Any, wall_s: float, steps: int, samples: int,
             peak_mb: float, cpu_util: float, sources: dict[str, str]) -> Profile:
    """The epoch's profile: every feature in :data:`PROFILE_FEATURES`."""
    features = {f"op_{k}_share": op_mix.shares[k] for k in OP_CATEGORIES}
    features.update(
        cpu_util=cpu_util,
        log_samples_per_s=math.log1p(samples / wall_s if wall_s > 0 else 0.0),
        # log(1 + CPU microseconds per sample): scale-free, never -inf.
        log_flops_proxy=math.log1p(1e6 * used.cpu_s / samples if samples > 0 else 0.0),
        ctx_switches_per_step=used.ctx_switches / steps if steps > 0 else 0.0,
        page_faults_per_step=used.page_faults / steps if steps > 0 else 0.0,
        log_peak_rss_mb=math.log1p(max(0.0, peak_mb)),
    )
    missing = set(PROFILE_FEATURES) - set(features)
    if missing:  # pragma: no cover - guards PROFILE_FEATURES growing without us
        raise AssertionError(f"profiler does not compute features {sorted(missing)}")
    return Profile(features={k: float(features[k]) for k in PROFILE_FEATURES},
                   sources=sources)


def _split_one_time(clock: _StepClock, recorder: OpMixRecorder | None,
                    own_wall_s: float) -> tuple[float, float]:
    """``(steady_step_s, one_time_s)`` of an epoch whose own time (the profiler's taken
    out) was ``own_wall_s``: the mean step of the steps after :data:`WARMUP_STEPS` that
    are neither traced nor outliers (:data:`OUTLIER_FACTOR` x the median), and what the
    epoch took beyond ``steps x`` that: compiling, recompiling, first steps, loader
    start. An epoch of too few steps to tell has no one-time part."""
    durations = clock.durations
    if recorder is not None:
        first, last = recorder.first_traced_step, recorder.last_traced_step
        steady = [d for i, d in enumerate(durations)
                  if i >= WARMUP_STEPS and not first <= i <= last]
    else:
        steady = durations[WARMUP_STEPS:]
    steps = len(durations)
    if len(steady) < 3:
        return (own_wall_s / steps if steps else 0.0), 0.0
    median = statistics.median(steady)
    kept = [d for d in steady if d <= OUTLIER_FACTOR * median] or steady
    if len(steady) - len(kept) > max(2, RARE_SHARE * len(steady)):
        # Slow steps that recur (a loader starved every few batches, contention) are
        # part of the steady rate, not a one-time event.
        kept = steady
    step_s = sum(kept) / len(kept)
    return step_s, max(0.0, own_wall_s - steps * step_s)


def _usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
