"""Searchers and schedulers of your own: handed to a study as objects, named in a job
file by an import path, or registered under a name; a bad name is refused by field.
Real tiny studies in this process (LocalBackend), nothing of pipetune edited."""

from __future__ import annotations

import sys
import textwrap

import pytest
from known import synthetic_job

from pipetune import policies
from pipetune.backends import LocalBackend
from pipetune.checkpoints import CheckpointStore
from pipetune.engine.study import Study
from pipetune.errors import SpecError
from pipetune.schedulers import Decision, NoopScheduler, Scheduler
from pipetune.searchers import Searcher
from pipetune.spec import JobSpec
from pipetune.system.config import MachineInfo

MACHINE = MachineInfo(cores=2)

#: A third party's module: a searcher that tries lr values in a fixed list, and a
#: scheduler that stops every trial after its first epoch.
THIRD_PARTY = '''
from pipetune.schedulers import Decision, Scheduler
from pipetune.searchers import Searcher


class Ladder(Searcher):
    def _suggest(self, trial_id):
        steps = (0.01, 0.02, 0.04, 0.08)
        return {"lr": steps[trial_id]} if trial_id < len(steps) else None


class FirstOnly(Scheduler):
    def _decide(self, trial_id, epoch, value):
        return Decision.STOP


def first_only(early_stopping, mode):
    return FirstOnly(early_stopping.max_epochs)


def not_a_searcher(space, mode, seed):
    return [space, mode, seed]
'''


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    folder = tmp_path / "vendor"
    folder.mkdir()
    name = f"ladder_{abs(hash(str(tmp_path))) % 10**8}"
    (folder / f"{name}.py").write_text(textwrap.dedent(THIRD_PARTY))
    monkeypatch.syspath_prepend(str(folder))
    yield name
    sys.modules.pop(name, None)


def job(**changes) -> dict:
    data = synthetic_job("policies", seed=1, trials=3)
    data["workload"]["params"]["cost_by_knob"] = {}
    data["pipetune"] = {"enabled": False}
    for section, values in changes.items():
        data[section] = {**data[section], **values}
    return data


def run(tmp_path, data: dict, **objects) -> Study:
    study = Study(JobSpec.from_dict(data, machine=MACHINE), study_id="policies",
                  checkpoints=CheckpointStore(tmp_path / "ck"), core_budget=2,
                  machine=MACHINE, **objects)
    study.run(LocalBackend())
    return study


def test_a_searcher_and_scheduler_of_your_own_by_import_path(tmp_path, third_party):
    study = run(tmp_path, job(search={"algorithm": f"{third_party}:Ladder", "trials": 4},
                              early_stopping={"policy": f"{third_party}:first_only"}))
    assert type(study.searcher).__name__ == "Ladder"
    assert type(study.scheduler).__name__ == "FirstOnly"
    lrs = [t.params["lr"] for t in sorted(study.trials.values(), key=lambda t: t.trial_id)]
    assert lrs == [0.01, 0.02, 0.04, 0.08]
    assert {t.epochs_run for t in study.trials.values()} == {1}  # stopped after epoch 1


def test_objects_handed_to_the_study_are_used_as_they_are(tmp_path, third_party):
    module = __import__(third_party)
    data = job(search={"trials": 2})
    spec = JobSpec.from_dict(data, machine=MACHINE)
    searcher = module.Ladder(spec.hyperparameters, mode="max", seed=0)
    scheduler = NoopScheduler(2)
    study = run(tmp_path, data, searcher=searcher, scheduler=scheduler)
    assert study.searcher is searcher and study.scheduler is scheduler
    assert sorted(t.params["lr"] for t in study.trials.values()) == [0.01, 0.02]
    assert {t.epochs_run for t in study.trials.values()} == {2}
    assert len(searcher.told) == 2  # the study told the searcher how each trial ended


def test_a_registered_name_resolves_in_a_job_file(tmp_path, third_party, monkeypatch):
    module = __import__(third_party)
    monkeypatch.setattr(policies, "_SEARCHERS", dict(policies._SEARCHERS))
    monkeypatch.setattr(policies, "_SCHEDULERS", dict(policies._SCHEDULERS))
    with pytest.raises(SpecError, match="search.algorithm.*got 'ladder'"):
        JobSpec.from_dict(job(search={"algorithm": "ladder"}), machine=MACHINE)
    policies.register_searcher("ladder", module.Ladder)
    policies.register_scheduler("first-only", module.first_only)
    study = run(tmp_path, job(search={"algorithm": "ladder", "trials": 2},
                              early_stopping={"policy": "first-only"}))
    assert isinstance(study.searcher, module.Ladder)
    assert isinstance(study.scheduler, Scheduler)
    assert {t.epochs_run for t in study.trials.values()} == {1}
    assert Decision.STOP is study.scheduler.on_epoch_result(99, 1, 0.5)


@pytest.mark.parametrize(("field", "section", "value", "words"), [
    ("search.algorithm", "search", {"algorithm": "bayes"}, "one of grid, random, tpe"),
    ("early_stopping.policy", "early_stopping", {"policy": "median"}, "one of asha, none"),
])
def test_an_unknown_name_is_refused_by_field(field, section, value, words):
    with pytest.raises(SpecError) as e:
        JobSpec.from_dict(job(**{section: value}), machine=MACHINE)
    assert e.value.field == field and words in str(e.value)
    assert "package.module:Factory" in str(e.value)


def test_an_import_path_that_fails_or_makes_the_wrong_thing_is_refused(tmp_path, third_party):
    with pytest.raises(SpecError, match=r"search.algorithm: cannot import 'no_such_mod:X'"):
        run(tmp_path / "a", job(search={"algorithm": "no_such_mod:X"}))
    with pytest.raises(SpecError, match=r"made a list, not a pipetune.searchers.Searcher"):
        run(tmp_path / "b", job(search={"algorithm": f"{third_party}:not_a_searcher"}))
    with pytest.raises(ValueError, match="a searcher name is a word"):
        policies.register_searcher("no spaces", Searcher)
