"""The simulated cluster: a real small study, played back on a simulated clock, takes the
same decisions in about the same time; epochs wait for a node with their cores free;
``pipetune simulate`` prints each strategy's cost and refuses bad input with exit 2."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from known import synthetic_job

from pipetune.backends import LocalBackend
from pipetune.checkpoints import CheckpointStore
from pipetune.engine.journal import StudyJournal
from pipetune.engine.study import Study
from pipetune.groundtruth import GroundTruth
from pipetune.simulate import Cluster, EpochTimes, SimulatedBackend, simulate_one
from pipetune.simulate.run import trial_rows
from pipetune.simulate.timing import Stopwatch, TimedGroundTruth
from pipetune.spec import JobSpec
from pipetune.system.config import MachineInfo, SystemConfig

MACHINE = MachineInfo(cores=1)


def _job() -> JobSpec:
    job = synthetic_job("sim-check", seed=3, trials=6)
    job["early_stopping"] = {"policy": "asha", "min_epochs": 1, "max_epochs": 4,
                             "reduction_factor": 2}
    job["objective"] = {"metric": "val_loss", "mode": "min", "system": "time"}
    return JobSpec.from_dict(job, machine=MACHINE)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """A real study (real training, real sleeps), PipeTune on, journaled."""
    root = tmp_path_factory.mktemp("real")
    journal = StudyJournal(root / "studies", "real-1").create(job_name="sim-check")
    study = Study(_job(), study_id="real-1", checkpoints=CheckpointStore(root / "ck"),
                  ground_truth=GroundTruth(root / "gt.db"), core_budget=1, machine=MACHINE,
                  journal=journal)
    study.run(LocalBackend())
    journal.close()
    return study, journal.events_path


def test_a_real_study_played_back_takes_the_same_decisions_in_about_its_time(real, tmp_path):
    study, journal = real
    times = EpochTimes.from_journals([journal])
    gt = TimedGroundTruth(tmp_path / "gt.db", Stopwatch())
    sim, replayed = simulate_one("pipetune-cold", _job(), times, Cluster(1, 1),
                                 ground_truth=gt, concurrent=1)
    # the same trials, stopped at the same rungs, each epoch in the same phase and config
    assert trial_rows(replayed) == trial_rows(study)
    assert sim.probe_epochs == study.summary().probe_epochs > 0
    assert len({t.state for t in study.trials.values()}) > 1  # ASHA stopped some
    results = [r for t in study.trials.values() for r in t.results]
    real_span = max(r.finished for r in results) - min(r.started for r in results)
    sim_span = sim.tuning_s - times.gap_s  # its first epoch starts one gap in
    assert abs(sim_span - real_span) <= 0.10 * real_span, (sim_span, real_span)
    assert sim.engine_s < sim_span  # the simulation is faster than the study


def _task(trial: int, cores: int, times: EpochTimes):
    src = times.records[0]
    from pipetune.runner import EpochTask

    return EpochTask(study_id="s", trial_id=trial, epoch=1, phase=src.result.phase,
                     system=SystemConfig(cores=cores), workload="synthetic",
                     workload_params={}, hparams=dict(src.hparams), seed=0,
                     checkpoint_in=None, checkpoint_out=f"/nowhere/{trial}")


def test_an_epoch_waits_for_a_node_with_its_cores_free(real):
    _, journal = real
    times = EpochTimes.from_journals([journal])
    one = dataclasses.replace(times.records[0].result, started=0.0, finished=2.0, build_s=0.0)
    times = EpochTimes([dataclasses.replace(times.records[0], result=one)], gap_s=0.5)
    backend = SimulatedBackend(times, nodes=2, cores_per_node=3, gap_s=0.5)
    for trial in range(3):  # 2 cores each: one per node, the third must wait
        backend.submit(_task(trial, 2, times))
    first, second = backend.wait(), backend.wait()
    assert {first.task.trial_id, second.task.trial_id} == {0, 1}
    assert first.result.started == 0.5 and first.result.finished == 2.5
    third = backend.wait()
    assert third.task.trial_id == 2 and third.result.started == 2.5  # when a node freed
    assert backend.clock == 4.5 and backend.usage.peak_running == 2
    assert backend.usage.core_s == pytest.approx(3 * 2 * 2.0)
    assert third.result.system.cores == 2 and third.result.worker.startswith("sim-node-")
    with pytest.raises(Exception, match="cores-per-node"):
        backend.submit(_task(9, 4, times))


def test_a_worker_builds_the_workload_once(real):
    """A recorded epoch is played without its process's first build; the simulated
    cluster charges that build when a node holds more cores at once than ever before
    (a new worker process there), not again."""
    _, journal = real
    recorded = EpochTimes.from_journals([journal]).records[0]
    built = dataclasses.replace(recorded.result, started=0.0, finished=3.0, build_s=1.0)
    times = EpochTimes([dataclasses.replace(recorded, result=built)], gap_s=0.0)
    assert times.first_build_s == 1.0 and times.records[0].wall_s == 2.0
    backend = SimulatedBackend(times, nodes=1, cores_per_node=2)
    backend.submit(_task(0, 1, times))
    backend.submit(_task(1, 1, times))
    first = [backend.wait().result for _ in range(2)]
    assert [r.finished for r in first] == [3.0, 3.0] and first[0].build_s == 1.0
    for trial in (2, 3):  # one at a time on the same node: its workers have built
        backend.submit(_task(trial, 1, times))
        later = backend.wait().result
        assert later.finished - later.started == 2.0 and later.build_s == 0.0


def test_an_unmeasured_config_is_played_as_the_nearest_measured_one_and_said(real):
    _, journal = real
    times = EpochTimes.from_journals([journal])
    backend = SimulatedBackend(times, nodes=1, cores_per_node=4)
    backend.submit(_task(0, 4, times))
    assert backend.wait().result.system.cores == 4
    (played, measured), = times.stand_ins
    assert played.cores == 4 and measured in times.configs()


def _pipetune(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipetune", *args], capture_output=True,
                          text=True, timeout=300)


def test_the_command_prints_each_strategy_and_writes_its_decisions(real, tmp_path):
    _, journal = real
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(_job().to_dict()))
    out = tmp_path / "sim.json"
    done = _pipetune("simulate", str(job), "--times", str(journal.parent), "--nodes", "3",
                     "--cores-per-node", "2", "--trials", "40", "--json", str(out))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for name in ("v1-default", "v1-one-core", "v2", "pipetune-cold", "pipetune-warm"):
        assert any(line.startswith(name) for line in lines), done.stdout
    assert any(line.startswith("pipetune-cold against ") for line in lines)
    written = json.loads(out.read_text())
    assert written["nodes"] == 3 and written["cores_per_node"] == 2
    by = {s["strategy"]: s for s in written["strategies"]}
    assert all(s["trials"] == 40 and len(s["trial_rows"]) == 40 for s in by.values())
    assert by["v1-one-core"]["concurrent"] == 6 and by["v1-default"]["concurrent"] == 3
    assert by["pipetune-warm"]["groundtruth_hits"] > by["pipetune-cold"]["groundtruth_hits"]
    assert by["v2"]["probe_epochs"] == 0 < by["pipetune-cold"]["probe_epochs"]


@pytest.mark.parametrize("args, field", [
    (["--nodes", "0"], "--nodes"),
    (["--strategy", "v3"], "--strategy"),
    (["--gap-s", "-1"], "--gap-s"),
])
def test_bad_input_names_the_field_with_exit_2(real, tmp_path, args, field):
    _, journal = real
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(_job().to_dict()))
    done = _pipetune("simulate", str(job), "--times", str(journal), *args)
    assert done.returncode == 2 and field in done.stderr and "Traceback" not in done.stderr


def test_a_times_file_that_is_no_journal_is_refused(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(_job().to_dict()))
    done = _pipetune("simulate", str(job), "--times", str(tmp_path / "nothing"))
    assert done.returncode == 2 and "--times" in done.stderr and "Traceback" not in done.stderr


def test_records_of_another_job_share_no_hyperparameter_and_are_refused(real):
    from pipetune.simulate import TimesError
    from pipetune.space import Uniform

    _, journal = real
    with pytest.raises(TimesError, match="none of this job's hyperparameters"):
        EpochTimes.from_journals([Path(journal)]).bind({"dropout": Uniform(0.0, 0.5)})
