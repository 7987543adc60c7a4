"""The study engine: the PipeTune loop as plain state, driven by any executor.

The engine owns the loop. An executor is an :class:`~pipetune.backends.EpochBackend`
(submit an epoch, wait for the next finished one); the engine decides everything
else, one finished epoch per :meth:`Study.step`::

    study = Study(spec, study_id="s1", checkpoints=CheckpointStore(root), ground_truth=gt)
    study.run(LocalBackend())                      # or DaskBackend(client), or the flow's
    study.summary()

Searcher, scheduler and system tuner are policies here; they never train, submit or
log. The engine writes the ground truth when the tuner says what to record. The rest
(journal, records, live table) hears of it through events (``study.observe(fn)``, with
a read-only :mod:`~pipetune.engine.view`); none calls back in.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipetune.engine.costing import Costing
from pipetune.engine.events import (
    Broke,
    Decided,
    EpochFailed,
    EpochFinished,
    EpochSent,
    LookedUp,
    Observer,
    Stepped,
    StudyEvent,
    TrialEnded,
    TrialStarted,
    Unconfirmed,
)
from pipetune.engine.failures import Broken, FailureCount, traceback_text
from pipetune.engine.in_flight import InFlight
from pipetune.engine.journal import JournalError
from pipetune.engine.known import job_key, unconfirmed_because
from pipetune.engine.one_time import OneTimeLedger, later_epochs_per_slot, trials_left
from pipetune.engine.remember import Remembering
from pipetune.engine.replay import replayable, store_refused
from pipetune.engine.trial import StepEvent, Trial
from pipetune.engine.view import StudyView
from pipetune.reports import StudySummary, study_summary
from pipetune.runner import EpochFailure, EpochResult, EpochTask
from pipetune.schedulers import Decision, Scheduler, make_scheduler
from pipetune.searchers import Searcher, TrialState, make_searcher
from pipetune.spec import split_system_params
from pipetune.system.config import MachineInfo, SystemConfig
from pipetune.tuner import EpochObservation, GroundTruthMatch, Phase, SystemTuner, TuningDecision

if TYPE_CHECKING:
    from pipetune.backends import EpochBackend
    from pipetune.checkpoints import CheckpointStore
    from pipetune.engine.journal import Event, StudyJournal
    from pipetune.groundtruth import GroundTruth
    from pipetune.spec import JobSpec

__all__ = ["Broken", "StepEvent", "Study", "StudyStuck", "StudySummary", "Trial",
           "run_study_locally"]


class StudyStuck(RuntimeError):
    """The engine has nothing to run and nothing running, yet the study is not done."""


class Study:
    """Bookkeeping of one tuning study over a :class:`~pipetune.spec.JobSpec`.

    ``core_budget`` is how many cores the executor offers at once (the machine's for
    the embedded cluster); an epoch task is only launchable when its system config's
    ``cores`` fit in what in-flight tasks leave free.
    """

    def __init__(
        self,
        spec: JobSpec,
        *,
        study_id: str,
        checkpoints: CheckpointStore,
        ground_truth: GroundTruth | None = None,
        core_budget: int | None = None,
        machine: MachineInfo | None = None,
        journal: StudyJournal | None = None,
        searcher: Searcher | None = None,
        scheduler: Scheduler | None = None,
    ):
        self.spec = spec
        self.study_id = study_id
        self.checkpoints = checkpoints
        self.ground_truth = ground_truth
        machine = machine or MachineInfo.detect()
        self.core_budget = core_budget or machine.cores
        self.metric = spec.objective.metric
        self.mode = spec.objective.mode
        self.objective = spec.objective.system
        # Policies handed over as objects are used as they are; otherwise the job's
        # names resolve through pipetune.policies (built-in, registered, import path).
        self.searcher = searcher if searcher is not None else make_searcher(
            spec.search.algorithm,
            spec.hyperparameters,
            mode=self.mode,
            seed=spec.search.seed,
            grid_points=spec.search.grid_points,
        )
        self.scheduler = scheduler if scheduler is not None else make_scheduler(
            spec.early_stopping, self.mode)
        self.tuner = SystemTuner(
            spec.system.default,
            spec.system.space,
            enabled=spec.pipetune.enabled,
            plan=spec.pipetune.probe_plan,
            max_probes=spec.pipetune.max_probes,
            machine=machine,
            max_cores=self._probe_core_limit(spec),
        )
        self.trials: dict[int, Trial] = {}
        self._systems: dict[SystemConfig, SystemConfig] = {}
        self._queue: deque[EpochTask] = deque()
        self._in_flight = InFlight()
        self._searcher_exhausted = False
        #: (trial, epoch) -> [ready, handed out, reported back] wall-clock times, for the
        #: orchestration-overhead figures (what happens around an epoch's own work).
        #: Ready -> handed out is the wait for free cores, not overhead.
        self.epoch_times: dict[tuple[int, int], list[float]] = {}
        #: Who hears the engine's events (:meth:`observe`), in order.
        self._observers: list[Observer] = []
        #: Where every journaled event is appended as it happens (None: the study
        #: cannot resume); the journal is the engine's first observer.
        self.journal = journal
        if journal is not None:
            self.observe(journal.observe)
        self._replaying = False
        #: Epochs that had finished before this study was resumed (not run again).
        self.resumed_epochs = 0
        #: Set when trials kept failing the same way before any epoch finished
        #: (``search.stop_after_failures``): nothing more is started, the study ends.
        self.broken: Broken | None = None
        self._ended_count = 0  # trials ended (the rest of self.trials run)
        #: This run's failures, against ``search.stop_after_failures``.
        self.failures = FailureCount(spec.search.failure_limit, spec.workload.name, study_id)
        #: The cost rule the system tuner compares configs by.
        self.costing = Costing(self.objective, spec.search.max_concurrent)
        #: What it writes to the ground truth: the config each trial kept.
        self.remembering = Remembering(ground_truth, spec, study_id, self.costing.unit)
        #: What each worker paid once per graph (a compile), and what an untried one costs.
        self.one_time = OneTimeLedger.for_study(spec, ground_truth)

    def _probe_core_limit(self, spec: JobSpec) -> int | None:
        """When trials run side by side and their defaults already fill the cores, and
        the tuner compares core-seconds (:meth:`epoch_cost`), a probe reserving more
        cores only wins with a superlinear speed-up, and meanwhile makes the other
        trials wait: do not probe it (measured on LeNet-5: cores=2 probes were 1.8 x
        slower per epoch and held both cores)."""
        concurrent = spec.search.max_concurrent
        if spec.objective.system != "time" or concurrent < 2:
            return None
        default = spec.system.default.cores
        return default if concurrent * default >= self.core_budget else None

    # -- what to run ----------------------------------------------------------------
    @property
    def max_epochs(self) -> int:
        return self.spec.early_stopping.max_epochs

    def _active(self) -> int:  # trials are made RUNNING, and leave it only through _end
        return len(self.trials) - self._ended_count

    def _free_cores(self) -> int:
        return self.core_budget - self._in_flight.cores

    def _start_trial(self) -> EpochTask | None:
        if self._searcher_exhausted or len(self.trials) >= self.spec.search.trials:
            return None
        suggestion = self.searcher.ask()
        if suggestion is None:
            self._searcher_exhausted = True
            return None
        trial = Trial(
            trial_id=suggestion.trial_id,
            params=dict(suggestion.params),
            seed=self.spec.search.seed * 100_003 + suggestion.trial_id,
            started=time.time(),
        )
        _, trial.fixed_system = split_system_params(trial.params, self.spec.system.default)
        self.trials[trial.trial_id] = trial
        self._emit(TrialStarted(trial))
        if (self.spec.pipetune.enabled and self.ground_truth is not None
                and trial.fixed_system is None and not self._replaying):
            asked = time.time()
            known = self.ground_truth.known(self.job_key(trial), self.objective)
            if known is not None:  # its first epoch confirms it (on_epoch_done)
                self.set_match(trial.trial_id, known, took=(asked, time.time()), known=True)
        decision = self.decide(trial.trial_id)
        trial.decisions.append(decision)
        return self._mark_ready(self._epoch_task(trial, decision))

    def _mark_ready(self, task: EpochTask) -> EpochTask:
        now = time.time()
        self.epoch_times[(task.trial_id, task.epoch)] = [now, math.nan, math.nan]
        return task

    def _epoch_task(self, trial: Trial, decision: TuningDecision) -> EpochTask:
        epoch = trial.epochs_run + 1
        return EpochTask(
            study_id=self.study_id,
            trial_id=trial.trial_id,
            epoch=epoch,
            phase=decision.phase,
            system=decision.system,
            workload=self.spec.workload.name,
            workload_params=dict(self.spec.workload.params),
            hparams=split_system_params(trial.params, self.spec.system.default)[0],
            seed=trial.seed,
            checkpoint_in=trial.checkpoint,
            checkpoint_out=self.checkpoints.ref(self.study_id, trial.trial_id, epoch),
            profiler=self.spec.profiler,
            timeout_s=self.spec.workload.epoch_timeout_s,
            deterministic=self.spec.workload.deterministic,
            compile_cache=self.spec.pipetune.compile_cache,
        )

    def final_task(self, trial: Trial) -> EpochTask:
        """A task describing the trial's last epoch (to rebuild its model elsewhere)."""
        last = trial.results[-1]
        decision = TuningDecision(system=last.system, phase=last.phase, remember=None,
                                  remember_cost=None, reason="final")
        task = self._epoch_task(trial, decision)
        return EpochTask(**{**task.__dict__, "epoch": last.epoch, "checkpoint_in": last.checkpoint,
                            "checkpoint_out": last.checkpoint})

    def launchable(self) -> list[EpochTask]:
        """Epoch tasks to submit now; each is counted in flight until reported back.

        Continuing trials go first (so early stopping sees results sooner), then new
        trials up to ``search.max_concurrent`` running at once.
        """
        out: list[EpochTask] = []
        free = self._free_cores()
        waiting: deque[EpochTask] = deque()
        while self._queue:
            task = self._queue.popleft()
            if task.system.cores <= free:
                free -= task.system.cores
                out.append(task)
            else:
                waiting.append(task)
        self._queue = waiting
        while (not self._queue and self._active() < self.spec.search.max_concurrent
               and self._may_start()):
            task = self._start_trial()
            if task is None:
                break
            if task.system.cores > free:
                self._queue.append(task)
                break
            free -= task.system.cores
            out.append(task)
        now = time.time()
        for task in out:
            self._in_flight.add(task)
            times = self.epoch_times.setdefault((task.trial_id, task.epoch), [now, now, math.nan])
            times[1] = now
        return out

    def _may_start(self) -> bool:
        """Whether a new trial may start. Not once the study is broken; and while no
        epoch has finished, only as many as could still fail the same way before the
        study stops (``search.stop_after_failures``): a broken workload starts at most
        that many trials. (With the default limit, ``max_concurrent + 1``, nothing is
        held back until a trial has failed.)"""
        if self.broken is not None:
            return False
        limit = self.spec.search.failure_limit
        if not limit or self._any_epoch_finished():
            return True
        return self._active() + max(self.failures.same.values(), default=0) < limit

    def _any_epoch_finished(self) -> bool:
        return self.failures.epochs_finished > 0

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def done(self) -> bool:
        if self.broken is not None:
            return not self._in_flight
        return (
            not self._in_flight
            and not self._queue
            and self._active() == 0
            and trials_left(self) == 0     # a grid that gave every point is done too
        )

    # -- what came back -------------------------------------------------------------
    def on_epoch_done(self, result: EpochResult) -> Decision:
        """Record a finished epoch; return whether the trial goes on (the scheduler's call).
        Observers hear of it (:class:`~pipetune.engine.events.EpochFinished`) before any policy
        is consulted, so a record of it survives a failing policy."""
        self._in_flight.pop(result.trial_id, result.epoch)
        if (result.trial_id, result.epoch) in self.epoch_times:
            self.epoch_times[(result.trial_id, result.epoch)][2] = time.time()
        trial = self.trials[result.trial_id]
        self.failures.epoch_finished()  # the store took this epoch's checkpoint
        trial.results.append(result)
        trial.history.append(self.observation(result))
        self.one_time.note(trial, result)
        self._emit(EpochFinished(trial, result))
        self._confirm_known(trial, result)
        value = result.metrics.get(self.metric)
        if value is None or math.isnan(value):
            self._end(trial, TrialState.FAILED, error=f"metric {self.metric!r} missing or NaN")
            return Decision.STOP
        decision = self.scheduler.on_epoch_result(result.trial_id, result.epoch, value)
        if self.broken is not None:  # ran while the study stopped: it ends here, cleanly
            decision = Decision.STOP
        if decision is Decision.STOP:
            state = TrialState.COMPLETE if result.epoch >= self.max_epochs else TrialState.STOPPED
            self._end(trial, state)
        return decision

    def job_key(self, trial: Trial) -> str:
        """What makes two trials the same job for the ground truth (:func:`job_key`)."""
        return job_key(self.spec, trial)

    def _confirm_known(self, trial: Trial, result: EpochResult) -> None:
        why = unconfirmed_because(trial, result, self.cost_unit)
        if why is not None:
            trial.baseline = 1
            trial.match = None
            self._emit(Unconfirmed(trial, why))

    def observation(self, result: EpochResult) -> EpochObservation:
        """What the system tuner sees of a finished epoch (:class:`Costing`)."""
        return self.costing.observation(result)

    @property
    def cost_unit(self) -> str:
        return self.costing.unit

    def epoch_cost(self, result: EpochResult) -> float:
        """What the system tuner compares configs by (:meth:`Costing.cost`)."""
        return self.costing.cost(result)

    def on_epoch_failed(self, trial_id: int, epoch: int, error: str,
                        failure: EpochFailure | None = None, *,
                        traceback_file: str | None = None) -> None:
        """An epoch raised (``failure``: the exception with its traceback, kept in the
        study's folder) or its worker was lost: the trial fails, and the study goes on
        unless trials keep failing this way before any epoch finished (:attr:`broken`).
        ``traceback_file``: where an earlier run kept the traceback (a replayed event)."""
        trial = self.trials[trial_id]
        trial.traceback_file = traceback_file
        if failure is not None:
            trial.failure = failure
            if self.journal is not None and not self._replaying:
                trial.traceback_file = str(self.journal.write_traceback(
                    trial_id, epoch, traceback_text(self.study_id, self.spec.workload.name,
                                                    trial, epoch, failure)))
        self._emit(EpochFailed(trial, epoch, error, trial.traceback_file))
        self._in_flight.pop(trial_id, epoch)
        self._end(trial, TrialState.FAILED, error=error)
        if failure is None or self._replaying or self.broken is not None:
            return
        self.broken = self.failures.count(trial, failure,
                                          any_epoch_finished=self._any_epoch_finished())
        if self.broken is not None:
            self._emit(Broke(trial, self.broken.line))
            self._stop_queued()

    def _stop_queued(self) -> None:
        """The study is broken: what waits to start never starts; what runs ends when
        its epoch comes back. A queued trial that never ran is forgotten (a resumed
        study starts it); one whose next epoch waits stays as it is (a resumed study
        runs that epoch from its last checkpoint)."""
        for task in self._queue:
            trial = self.trials.get(task.trial_id)
            if trial is not None and not trial.results:
                self.trials.pop(task.trial_id, None)
        self._queue.clear()

    def needs_lookup(self, trial_id: int) -> bool:
        trial = self.trials[trial_id]
        return (
            self.spec.pipetune.enabled
            and self.ground_truth is not None
            and trial.match is None
            and trial.epochs_run == trial.baseline + 1
            and trial.results[trial.baseline].phase is Phase.PROFILE
        )

    def lookup(self, trial_id: int) -> GroundTruthMatch:
        """Look the trial's epoch-1 profile up in the ground truth."""
        trial = self.trials[trial_id]
        first = trial.results[trial.baseline]
        assert self.ground_truth is not None
        return self.ground_truth.lookup(
            first.measurement.profile, first.batch_size, self.objective
        )

    def set_match(self, trial_id: int, match: GroundTruthMatch, *,
                  took: tuple[float, float] | None = None, known: bool = False) -> None:
        """Give the trial its ground-truth answer (``took``: when the lookup started and
        ended, for observers; ``known``: its job was recognised at its start)."""
        trial = self.trials[trial_id]
        now = time.time()
        self._emit(LookedUp(trial, match, *(took or (now, now)), known=known))
        trial.match = match
        if self._replaying and trial.epochs_run == 0 and match.known_graph is not None:
            # A known job's first epoch runs under its config: decide it again now that
            # the replayed match is here (the replayed start decided without it).
            self._queue = deque(t for t in self._queue if t.trial_id != trial_id)
            decision = self.decide(trial_id)
            trial.decisions[:] = [decision]
            self._queue.append(self._mark_ready(self._epoch_task(trial, decision)))

    def decide(self, trial_id: int) -> TuningDecision:
        """Ask the system tuner for the trial's next epoch config."""
        trial = self.trials[trial_id]
        if trial.fixed_system is not None:
            return TuningDecision(system=trial.fixed_system, phase=Phase.TRAIN,
                                  remember=None, remember_cost=None,
                                  reason="system knobs set by the trial's params")
        return self.tuner.next_epoch(
            trial.tuner_history(), epochs_left=self.max_epochs - trial.epochs_run,
            match=trial.match, sure_epochs=self.scheduler.sure_epochs(trial.epochs_run),
            expected_epochs=self.scheduler.expected_epochs(trial.epochs_run),
            known_one_time=self.one_time.for_next_epoch(trial),
            one_time_price=self.one_time.price(),
            reuse_epochs=later_epochs_per_slot(self.spec, self.scheduler, trials_left(self)),
            probed_elsewhere=self._in_flight.one_time_probe_elsewhere(trial_id),
            alone_cores=self._idle_cores_for(trial),
        )

    def _idle_cores_for(self, trial: Trial) -> int | None:
        """All the cores, when ``trial`` is the only one running and no trial is left to
        start (nothing would wait for them), in a study that runs trials side by side
        (one at a time: a trial's cores are what its config asks, tail or not); else None."""
        if self.objective != "time" or self._queue or self.spec.search.max_concurrent < 2:
            return None
        if trials_left(self):
            return None
        others = self._active() - (trial.state == TrialState.RUNNING)
        return None if others else min(self.core_budget, self.tuner.machine.cores)

    def apply_decision(self, trial_id: int, decision: TuningDecision, *,
                       took: tuple[float, float] | None = None) -> EpochTask:
        """Queue the trial's next epoch under ``decision``; record the best config if told.
        ``took``: when the decision was asked and made, for observers."""
        trial = self.trials[trial_id]
        now = time.time()
        self._emit(Decided(trial, trial.epochs_run, decision, *(took or (now, now))))
        trial.decisions.append(decision)
        if decision.remember is not None and decision.remember_cost is not None:
            self.remembering.remember(
                trial, decision.remember, decision.remember_cost,
                one_time=decision.remember_one_time, speedup=decision.remember_speedup,
                replaying=self._replaying)
        task = self._mark_ready(self._epoch_task(trial, decision))
        self._queue.append(task)
        return task

    # -- events and the journal -------------------------------------------------------
    def observe(self, observer: Observer) -> Observer:
        """``observer(event)`` hears every event from now on, in order, before the
        engine acts on the next thing (:mod:`pipetune.engine.events`); returns it."""
        self._observers.append(observer)
        return observer

    def unobserve(self, observer: Observer) -> None:
        if observer in self._observers:
            self._observers.remove(observer)

    def _emit(self, event: StudyEvent) -> None:
        if self._replaying:  # heard, journaled and recorded before the study stopped
            return
        for observer in list(self._observers):
            observer(event)

    def replay(self, events: list[Event], *, checkpoint_exists: Callable[[str], bool]) -> int:
        """Bring this fresh engine to where the journal's study stopped; return the
        number of finished epochs taken over (they are not run again).

        The events are fed to the engine's own methods, in the same order, so the
        searcher is asked and told, the scheduler sees each result, and each trial gets
        its match and decisions exactly as before; nothing is emitted again (the
        journal and the ground truth have them). What was running when the study
        stopped is queued again: a trial's interrupted epoch restarts from its last
        checkpoint. A running trial whose newest checkpoints never reached storage
        (a journal of a pipetune that wrote them in the background, or a store that
        lost them) gives those epochs back: they run again
        (:func:`pipetune.engine.replay.replayable`). A trial that failed because the checkpoint
        store refused its checkpoint (:func:`pipetune.engine.replay.store_refused`) was not at
        fault: it goes on from its last checkpoint on storage."""
        if self.trials:
            raise JournalError("replay needs a fresh study")
        keep = replayable(events, checkpoint_exists)
        self._replaying = True
        try:
            for event in events:
                if keep(event):
                    self._replay_one(event)
        finally:
            self._replaying = False
        # The study stopped between a trial's finished epoch and its next decision: plan
        # that epoch now, as the engine would have (journaled like any other).
        queued = {t.trial_id for t in self._queue}
        for trial in list(self.trials.values()):
            if (trial.state == TrialState.RUNNING and trial.results
                    and trial.trial_id not in queued):
                self._plan_next(trial)
        return self.resumed_epochs

    def _replay_one(self, event: Event) -> None:
        if event.kind == "start":
            task = self._start_trial()
            trial = self.trials.get(event.trial)
            if task is None or trial is None or trial.params != event.data:
                raise JournalError(
                    f"study {self.study_id}: the searcher no longer proposes trial "
                    f"{event.trial} with {event.data} (was the job changed?)")
            self._queue.append(task)
        elif event.kind == "result":
            self._unqueue(event.trial, event.data.epoch)
            self.on_epoch_done(event.data)
            self.resumed_epochs += 1
        elif event.kind == "failed" and store_refused(event):
            pass  # the trial goes on: its refused epoch stays queued (or is planned)
        elif event.kind == "failed":  # (epoch, error, traceback file or None)
            epoch, error, traceback_file = event.data
            self._unqueue(event.trial, epoch)
            self.on_epoch_failed(event.trial, epoch, error, traceback_file=traceback_file)
        elif event.kind == "match":
            self.set_match(event.trial, event.data)
        elif event.kind == "decision":
            self.apply_decision(event.trial, event.data)

    def _unqueue(self, trial_id: int, epoch: int) -> None:
        self._queue = deque(t for t in self._queue if (t.trial_id, t.epoch) != (trial_id, epoch))

    # -- the loop ---------------------------------------------------------------------
    def step(self, backend: EpochBackend) -> StepEvent:
        """Submit every epoch that fits, wait for one to finish, and act on it: record
        it, end the trial or look its profile up and decide its next epoch. Observers
        hear each of those as it happens. Returns what happened to the trial whose epoch
        finished."""
        for task in self.launchable():
            backend.submit(task)
            self._emit(EpochSent(task))
        if not self._in_flight:
            raise StudyStuck("nothing launchable and nothing in flight")
        outcome = backend.wait()
        task = outcome.task
        trial = self.trials[task.trial_id]
        if outcome.error is not None:
            self.on_epoch_failed(task.trial_id, task.epoch, outcome.error, outcome.failure)
            return self._ended(backend, StepEvent(trial, None, ended=True))
        result = outcome.result
        assert result is not None
        if self.on_epoch_done(result) is Decision.CONTINUE:
            self._plan_next(trial)
            event = StepEvent(trial, result, ended=False)
            self._emit(Stepped(StudyView(self)))
            return event
        return self._ended(backend, StepEvent(trial, result, ended=True))

    def _plan_next(self, trial: Trial) -> None:
        """Look the trial's profile up (after its first profiled epoch) and queue its
        next epoch under the system tuner's decision."""
        if self.needs_lookup(trial.trial_id):
            match, took = self._timed(trial, "lookup", self.lookup, trial.trial_id)
            self.set_match(trial.trial_id, match, took=took)
        decision, took = self._timed(trial, "decide", self.decide, trial.trial_id)
        self.apply_decision(trial.trial_id, decision, took=took)

    def _ended(self, backend: EpochBackend, event: StepEvent) -> StepEvent:
        backend.release(self.study_id, event.trial.trial_id)  # its checkpoints on storage
        self._emit(TrialEnded(event.trial))
        event.trial.compact(self._systems)  # recorded: keep only what the end reads
        self._emit(Stepped(StudyView(self)))
        return event

    def _timed(self, trial: Trial, what: str, policy: Callable[[int], Any],
               trial_id: int) -> tuple[Any, tuple[float, float]]:
        """Call a policy; when it raises, observers hear of it (a failed span) first."""
        started = time.time()
        try:
            answer = policy(trial_id)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            if what == "lookup":
                self._emit(LookedUp(trial, None, started, time.time(), error=error))
            else:
                self._emit(Decided(trial, trial.epochs_run, None, started, time.time(),
                                   error=error))
            raise
        return answer, (started, time.time())

    def run(
        self,
        backend: EpochBackend,
        *,
        on_step: Callable[[StepEvent], None] | None = None,
        on_result: Callable[[Trial, EpochResult], None] | None = None,
    ) -> Study:
        """Step until the study is done. ``on_step`` sees what each step did;
        ``on_result(trial, result)`` each finished epoch before any policy runs (a
        shorthand for observing :class:`~pipetune.engine.events.EpochFinished`). On any error
        the backend's running epochs are cancelled."""
        def results(event: StudyEvent) -> None:
            if isinstance(event, EpochFinished) and on_result is not None:
                on_result(event.trial, event.result)

        self.observe(results)
        try:
            self._emit(Stepped(StudyView(self)))
            while not self.done:
                event = self.step(backend)
                if on_step is not None:
                    on_step(event)
        except BaseException:
            backend.cancel()
            raise
        finally:
            self.unobserve(results)
        backend.release(self.study_id)
        return self

    # -- ending ---------------------------------------------------------------------
    def _end(self, trial: Trial, state: TrialState, error: str | None = None) -> None:
        if trial.state != TrialState.RUNNING:
            return
        trial.state, trial.error, trial.ended = state, error, time.time()
        self._ended_count += 1
        self._queue = deque(t for t in self._queue if t.trial_id != trial.trial_id)
        if state is not TrialState.FAILED:
            self.remembering.at_end(self.tuner, trial, replaying=self._replaying)
        self.searcher.tell(trial.trial_id, trial.last_value(self.metric), state)
        self.scheduler.on_trial_remove(trial.trial_id)

    # -- reporting ------------------------------------------------------------------
    def best_trial(self) -> Trial | None:
        scored = [
            t for t in self.trials.values()
            if t.state != TrialState.FAILED and t.last_value(self.metric) is not None
        ]
        if not scored:
            return None
        sign = 1.0 if self.mode == "max" else -1.0
        return max(scored, key=lambda t: (sign * t.last_value(self.metric), -t.trial_id))

    def summary(self) -> StudySummary:
        return study_summary(self)


def run_study_locally(study: Study, run=None) -> Study:
    """Drive ``study`` to the end in this process, one epoch at a time.

    The reference executor: no Prefect, no Dask. ``run`` defaults to
    :func:`pipetune.runner.run_epoch` with models kept in memory between epochs.
    """
    from pipetune.backends import LocalBackend

    return study.run(LocalBackend(run))
