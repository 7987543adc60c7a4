"""The engine's one loop (Study.step / Study.run over an EpochBackend), with real
tiny training in this process."""

from __future__ import annotations

import pytest
from known import synthetic_job

from pipetune.backends import EpochBackend, EpochOutcome, LocalBackend
from pipetune.checkpoints import CheckpointStore
from pipetune.engine.events import Decided, EpochFinished, Stepped, StudyEvent
from pipetune.engine.study import Study, StudyStuck
from pipetune.spec import JobSpec
from pipetune.system.config import MachineInfo, SystemConfig

MACHINE = MachineInfo(cores=2)


def study(tmp_path, **changes) -> Study:
    job = synthetic_job("engine", seed=1, trials=2)
    job["workload"]["params"]["cost_by_knob"] = {}
    for section, values in changes.items():
        job[section] = {**job[section], **values}
    return Study(JobSpec.from_dict(job, machine=MACHINE), study_id="engine",
                 checkpoints=CheckpointStore(tmp_path / "ck"), core_budget=2, machine=MACHINE)


class ReversingBackend(LocalBackend):
    """A backend at the edge: finishes the most recently submitted epoch first."""

    def wait(self) -> EpochOutcome:
        self._queue.rotate(1)
        return super().wait()


def test_run_drives_every_planned_epoch_on_any_backend(tmp_path):
    """Planned equals actual, whatever order the backend finishes epochs in."""
    for backend in (LocalBackend(), ReversingBackend()):
        s = study(tmp_path / type(backend).__name__,
                  search={"max_concurrent": 2, "algorithm": "random"},
                  system={"space": {"interop_threads": [1, 2]}})
        events = []
        s.run(backend, on_step=events.append)
        assert s.done and len(s.trials) == 2
        assert len(events) == 6 == sum(t.epochs_run for t in s.trials.values())
        assert [e.ended for e in events].count(True) == 2
        for trial in s.trials.values():
            assert [r.epoch for r in trial.results] == [1, 2, 3]
            assert trial.results[1].reused_model  # the model stayed in memory


def test_on_result_sees_an_epoch_before_the_policies_run(tmp_path):
    s = study(tmp_path)
    seen: list[int] = []
    heard: list[StudyEvent] = []
    planned = s.decide

    def failing_decide(trial_id: int):
        if not s.trials[trial_id].results:  # the trial's first epoch is planned at its start
            return planned(trial_id)
        assert s.trials[trial_id].results[-1].epoch in seen  # recorded first
        raise RuntimeError("policy broke")

    s.decide = failing_decide
    s.observe(heard.append)
    with pytest.raises(RuntimeError, match="policy broke"):
        s.run(LocalBackend(), on_result=lambda trial, r: seen.append(r.epoch))
    assert seen == [1]
    # Observers heard the epoch, then the decision that raised (a failed span).
    finished = next(i for i, e in enumerate(heard) if isinstance(e, EpochFinished))
    failed = [e for e in heard if isinstance(e, Decided)]
    assert len(failed) == 1 and failed[0].error == "RuntimeError: policy broke"
    assert heard.index(failed[0]) > finished and not failed[0].journaled


def test_observers_hear_every_event_in_order_and_the_journal_keeps_the_replayed_kinds(
        tmp_path):
    """The engine's events, in the order things happened; the journal (an observer)
    appends exactly the kinds a resume replays."""
    from pipetune.engine.journal import StudyJournal

    journal = StudyJournal(tmp_path / "studies", "engine").create()
    s = Study(study(tmp_path).spec, study_id="engine", checkpoints=CheckpointStore(tmp_path / "ck"),
              core_budget=2, machine=MACHINE, journal=journal)
    heard: list[StudyEvent] = []
    s.observe(heard.append)
    s.run(LocalBackend())
    kinds = [type(e).__name__ for e in heard]
    assert kinds.count("TrialStarted") == 2 and kinds.count("TrialEnded") == 2
    assert kinds.count("EpochSent") == kinds.count("EpochFinished") == 6
    for trial_id in (0, 1):
        mine = [type(e).__name__ for e in heard if e.trial_id == trial_id]
        assert mine[:2] == ["TrialStarted", "EpochSent"] and mine[-1] == "TrialEnded"
        assert mine.index("EpochFinished") < mine.index("Decided")
    assert isinstance(heard[-1], Stepped) and heard[-1].view.study_id == s.study_id
    journaled = [e.journal_kind for e in heard if e.journaled]
    assert [e.kind for e in journal.events()] == journaled
    assert set(journaled) == {"start", "result", "decision"}


def test_a_backend_with_nothing_to_run_is_reported_stuck(tmp_path):
    class Idle(EpochBackend):
        def submit(self, task):  # never runs anything
            pass

        def wait(self):
            raise AssertionError("not reached")

    s = study(tmp_path, system={"default": {"cores": 2}})
    s.core_budget = 1  # a config that can never fit
    with pytest.raises(StudyStuck):
        s.step(Idle())


def test_side_by_side_trials_compare_core_seconds_and_skip_wider_probes(tmp_path):
    side = study(tmp_path / "a", search={"max_concurrent": 2},
                 system={"space": {"cores": [1, 2], "interop_threads": [1, 2]}})
    assert all(c.cores == 1 for c in side.tuner.candidates())
    assert any("cores=2" in d for d in side.tuner.dropped)
    alone = study(tmp_path / "b", search={"max_concurrent": 1},
                  system={"space": {"cores": [1, 2]}})
    assert any(c.cores == 2 for c in alone.tuner.candidates())

    s = study(tmp_path / "c", search={"max_concurrent": 1})
    backend = LocalBackend()
    backend.submit(s.launchable()[0])
    epoch = backend.wait().result
    two = type(epoch)(**{**epoch.__dict__, "system": SystemConfig(cores=2)})
    assert s.epoch_cost(two) == pytest.approx(epoch.cost("time"))  # alone: plain seconds
    side_cost = study(tmp_path / "d", search={"max_concurrent": 2}).epoch_cost(two)
    assert side_cost == pytest.approx(2 * epoch.cost("time"))


def test_side_by_side_a_config_pays_for_the_cpu_it_kept_busy_beyond_its_cores(tmp_path):
    """DataLoader workers run beside the cores a trial reserves: side by side, an epoch
    that kept 1.6 CPUs busy on a 1-core reservation costs 1.6 core-seconds a second;
    alone, plain seconds."""
    import dataclasses

    s = study(tmp_path / "a", search={"max_concurrent": 1})
    backend = LocalBackend()
    backend.submit(s.launchable()[0])
    epoch = backend.wait().result
    m = epoch.measurement
    busy = dataclasses.replace(m, cpu_s=1.6 * m.own_wall_s + m.overhead_in_epoch_s)
    loader = type(epoch)(**{**epoch.__dict__, "measurement": busy,
                            "system": SystemConfig(cores=1, dataloader_workers=1)})
    assert busy.cores_busy == pytest.approx(1.6)
    assert s.epoch_cost(loader) == pytest.approx(busy.cost("time"))
    side = study(tmp_path / "b", search={"max_concurrent": 2})
    assert side.epoch_cost(loader) == pytest.approx(1.6 * busy.cost("time"))
    assert side.observation(loader).cost == pytest.approx(1.6 * busy.cost("time"))
    idle = dataclasses.replace(m, cpu_s=0.3 * m.own_wall_s + m.overhead_in_epoch_s)
    waiting = type(epoch)(**{**epoch.__dict__, "measurement": idle})
    assert side.epoch_cost(waiting) == pytest.approx(idle.cost("time"))  # its 1 core


def test_observers_get_a_read_only_view_of_the_study_never_the_engine(tmp_path):
    from pipetune.engine.view import StudyView, TrialRow

    s = study(tmp_path, search={"max_concurrent": 2, "algorithm": "random"})
    views: list[StudyView] = []
    rows_then: list[list[TrialRow]] = []

    def watch(event: StudyEvent) -> None:
        if isinstance(event, Stepped):
            views.append(event.view)
            rows_then.append(event.view.trials())

    s.observe(watch)
    s.run(LocalBackend())
    view = views[-1]
    assert isinstance(view, StudyView) and not hasattr(view, "step")
    assert not any(hasattr(v, "study") for v in views)
    assert (view.name, view.trials_planned, view.trials_started) == ("engine", 2, 2)
    assert [r.trial_id for r in view.trials()] == [0, 1]
    assert [r.trial_id for r in view.trials(last=1)] == [1]
    assert all(r.epochs_run == 3 and r.state == "completed" for r in view.trials())
    best = view.best()
    assert best is not None and best.trial_id == s.best_trial().trial_id
    assert best.value == s.best_trial().last_value(s.metric)
    # What a read returned stays as it was: a snapshot, not a window on the engine.
    first_read = next(rows for rows in rows_then if rows)
    assert first_read[0].epochs_run < 3 == view.trials()[0].epochs_run
    with pytest.raises(AttributeError):
        first_read[0].epochs_run = 5


def test_an_ended_trial_keeps_a_compact_record_after_its_observers_saw_it_whole(tmp_path):
    """A long study's memory: once a trial ended and its observers recorded it (the
    MLflow profile table is made then), each of its epochs keeps what the study's end
    reads (times, energy, metrics, config, checkpoint), not its profile vector, counters
    and operator mix; the study keeps one instance of each system config."""
    import pickle

    s = study(tmp_path, search={"max_concurrent": 2, "algorithm": "random"},
              system={"space": {"interop_threads": [1, 2]}})
    whole: dict[int, list] = {}

    def at_end(event: StudyEvent) -> None:
        if event.name == "trial_ended":
            whole[event.trial_id] = [
                (dict(r.measurement.profile.features), r.measurement.wall_s,
                 r.measurement.energy_j, dict(r.metrics), r.checkpoint, len(pickle.dumps(r)))
                for r in event.trial.results]

    s.observe(at_end)
    s.run(LocalBackend())
    assert sorted(whole) == [0, 1]
    for trial in s.trials.values():
        seen = whole[trial.trial_id]
        assert seen[0][0]  # the observers had the profiled epoch's profile
        for r, (_, wall_s, energy_j, metrics, checkpoint, size) in zip(
                trial.results, seen, strict=True):
            m = r.measurement
            assert not m.profile.features and not m.counters and not m.op_mix
            assert (m.wall_s, m.energy_j, r.metrics, r.checkpoint) == (
                wall_s, energy_j, metrics, checkpoint)
            assert len(pickle.dumps(r)) < 0.7 * size
    configs = [r.system for t in s.trials.values() for r in t.results]
    assert len({id(c) for c in configs}) == len(set(configs))
    summary = s.summary()
    assert summary.epochs_run == 6
    assert summary.compute_s >= sum(w for seen in whole.values() for _, w, *_ in seen)
