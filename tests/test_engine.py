"""The engine's one loop (Study.step / Study.run over an EpochBackend), with real
tiny training in this process."""

from __future__ import annotations

import pytest
from known import synthetic_job

from pipetune.backends import EpochBackend, EpochOutcome, LocalBackend
from pipetune.checkpoints import CheckpointStore
from pipetune.spec import JobSpec
from pipetune.study import Study, StudyStuck
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

    def failing_decide(trial_id: int, epoch: int):
        assert epoch in seen  # recorded first
        raise RuntimeError("policy broke")

    with pytest.raises(RuntimeError, match="policy broke"):
        s.run(LocalBackend(), on_result=lambda trial, r: seen.append(r.epoch),
              decide=failing_decide)
    assert seen == [1]


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
