"""Knobs with a one-time cost (``compile``) and the CPU knobs that go with them
(channels_last, bf16): known answers for the tuner's projection, a real study on a
workload whose one-time cost and speed-up are known, checkpoints that move between
compiled and eager, and the refusal of bf16 where the processor lacks it."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from known import synthetic_job

from pipetune.checkpoints import CheckpointStore
from pipetune.engine.journal import StudyJournal
from pipetune.engine.study import Study, run_study_locally
from pipetune.groundtruth import GroundTruth
from pipetune.profiler.profile import EpochMeasurement, Profile
from pipetune.schedulers import ASHAScheduler
from pipetune.spec import JobSpec
from pipetune.states import GroundTruthMatch, Phase
from pipetune.system.config import MachineInfo, SystemConfig
from pipetune.tuner import (
    MIN_ONE_TIME_HORIZON,
    ONE_TIME_PRICE_PRIOR_S,
    ONE_TIME_SAVING_PRIOR,
    EpochObservation,
    OneTimePrice,
    SystemTuner,
)

ROOT = Path(__file__).resolve().parents[1]
MACHINE = MachineInfo(cores=2)
DEFAULT = SystemConfig()
COMPILED = DEFAULT.replace(compile=True)
SAMPLES = 1000


def obs(epoch, phase, system, steady, one_time=0.0):
    """An epoch of SAMPLES samples at ``steady`` s/sample plus ``one_time`` s once."""
    return EpochObservation(epoch, phase, system, cost=steady + one_time / SAMPLES,
                            steady=steady, one_time=one_time, samples=SAMPLES)


def hit(one_time, speedup, config=COMPILED):
    return GroundTruthMatch(True, config, 0.005, 0, 0, 0.5, 2.0, 3, "similar",
                            one_time=one_time, speedup=speedup)


# -- the policy, known answers ---------------------------------------------------------------

def test_an_unknown_one_time_knob_is_probed_only_when_the_seconds_it_would_save_pay_its_price():
    tuner = SystemTuner(DEFAULT, {"compile": [False, True]}, machine=MACHINE)
    first = [obs(1, "profile", DEFAULT, 0.01)]    # 10 s epochs
    # Nothing measured yet: a compile is taken to cost ONE_TIME_PRICE_PRIOR_S (20 s) and
    # save ONE_TIME_SAVING_PRIOR (20%): 8 epochs save 16 s, not enough; 12 save 24 s.
    assert (ONE_TIME_PRICE_PRIOR_S, ONE_TIME_SAVING_PRIOR) == (20.0, 0.2)
    short = tuner.next_epoch(first, epochs_left=12, match=None, sure_epochs=8)
    assert short.phase is Phase.TRAIN and short.system == DEFAULT
    assert ("compile=True not probed: saves ~16 over 8 sure epoch(s) at 20% <= 20 once "
            "(prior)") in short.reason
    long = tuner.next_epoch(first, epochs_left=12, match=None, sure_epochs=12)
    assert long.phase is Phase.PROBE and long.system == COMPILED
    assert "saves ~24 over 12 sure epoch(s) > 20 once, prior" in long.reason
    # The price is in seconds, not epochs: 3 epochs of 50 s save 30 s > 20 s.
    big = [obs(1, "profile", DEFAULT, 0.05)]
    assert tuner.next_epoch(big, epochs_left=3, match=None, sure_epochs=3).system == COMPILED
    # A price measured (by this study or the ground truth) replaces the prior: 2 s once
    # at 50% is paid by 3 epochs of 10 s.
    measured = OneTimePrice(2.0, 0.5, "ground truth, 1 job(s)")
    cheap = tuner.next_epoch(first, epochs_left=3, match=None, sure_epochs=3,
                             one_time_price=measured)
    assert cheap.system == COMPILED
    assert cheap.inputs["price_from"] == "ground truth, 1 job(s)"
    assert cheap.inputs["expected_saving"] == 15.0 and cheap.inputs["one_time_price"] == 2.0
    # A trial that trained on (short horizon) and then passed a rung probes it then.
    trained = [*first, obs(2, "train", DEFAULT, 0.01)]
    later = tuner.next_epoch(trained, epochs_left=11, match=None, sure_epochs=11)
    assert later.phase is Phase.PROBE and later.system == COMPILED
    # Epochs of unknown size: the horizon in epochs decides (MIN_ONE_TIME_HORIZON).
    blind = [EpochObservation(1, "profile", DEFAULT, cost=0.01)]
    assert tuner.next_epoch(blind, epochs_left=8, match=None,
                            sure_epochs=MIN_ONE_TIME_HORIZON).system == COMPILED
    assert tuner.next_epoch(blind, epochs_left=8, match=None,
                            sure_epochs=MIN_ONE_TIME_HORIZON - 1).system == DEFAULT


def test_after_probing_the_steady_rate_decides_and_the_one_time_figures_are_recorded():
    tuner = SystemTuner(DEFAULT, {"compile": [True]}, machine=MACHINE)
    history = [obs(1, "profile", DEFAULT, 0.010, one_time=0.4),
               obs(2, "probe", COMPILED, 0.005, one_time=6.0)]
    decision = tuner.next_epoch(history, epochs_left=1, match=None, sure_epochs=1)
    # The compile is paid already: from here on only the steady rate counts.
    assert decision.system == COMPILED and decision.remember == COMPILED
    assert decision.remember_cost == pytest.approx(0.005)
    assert decision.remember_one_time == pytest.approx(6.0)
    assert decision.remember_speedup == pytest.approx(2.0)
    slower = [history[0], obs(2, "probe", COMPILED, 0.012, one_time=6.0)]
    assert tuner.next_epoch(slower, epochs_left=1, match=None).system == DEFAULT


@pytest.mark.parametrize(("sure", "compiles"), [(1, False), (2, True), (6, True)])
def test_a_known_compile_is_applied_exactly_when_the_sure_epochs_earn_it_back(sure, compiles):
    # Default 0.01 s/sample x 1000 samples = 10 s per epoch; compiled 2x faster saves 5 s
    # per epoch; the compile costs 8 s once: one epoch does not pay, two do.
    tuner = SystemTuner(DEFAULT, {"compile": [True]}, machine=MACHINE)
    history = [obs(1, "profile", DEFAULT, 0.01)]
    decision = tuner.next_epoch(history, epochs_left=8, match=hit(8.0, 2.0), sure_epochs=sure)
    assert decision.phase is Phase.TRAIN
    assert decision.system == (COMPILED if compiles else DEFAULT)
    assert decision.inputs["gain"] == pytest.approx(5.0 * sure)
    assert ("pays" if compiles else "does not pay") in decision.reason


def test_a_reused_config_slower_than_the_trials_own_default_falls_back_to_probing():
    tuner = SystemTuner(DEFAULT, {"compile": [True], "channels_last": [True]}, machine=MACHINE)
    match = hit(1.0, 2.0)
    history = [obs(1, "profile", DEFAULT, 0.01)]
    assert tuner.next_epoch(history, epochs_left=5, match=match).system == COMPILED
    # Here the reused compile ran 1.5x slower than this trial's default (another model).
    history.append(obs(2, "train", COMPILED, 0.015, one_time=3.0))
    decision = tuner.next_epoch(history, epochs_left=4, match=match, sure_epochs=4)
    assert decision.phase is Phase.PROBE and "ran 1.50x this trial's default" in decision.reason
    assert decision.system == DEFAULT.replace(channels_last=True)
    # Within 10% of the default, the reuse stands.
    fine = [history[0], obs(2, "train", COMPILED, 0.0105, one_time=3.0)]
    assert tuner.next_epoch(fine, epochs_left=4, match=match).system == COMPILED


def test_the_scheduler_says_how_many_epochs_are_sure():
    asha = ASHAScheduler(min_epochs=1, max_epochs=9, reduction_factor=3)
    assert [asha.sure_epochs(n) for n in (1, 2, 3, 5, 8)] == [2, 1, 6, 4, 1]


def test_a_measurement_splits_its_one_time_part_from_its_steady_rate():
    m = EpochMeasurement(
        wall_s=12.0, samples=1000, steps=10, cpu_s=12.0, cpu_util=1.0, peak_rss_mb=1.0,
        ctx_switches=0, page_faults=0, energy_j=120.0, energy_source="estimate",
        counters_source="psutil", op_mix={}, counters={}, overhead_s=0.0,
        profile=Profile({}), one_time_s=2.0, steady_step_s=1.0)
    assert m.cost("time") == pytest.approx(0.012)
    assert m.steady_cost("time") == pytest.approx(0.010)
    assert m.one_time_cost("energy") == pytest.approx(20.0)
    assert m.steady_cost("energy") == pytest.approx(0.1)


# -- a real study on a workload whose one-time cost is known ------------------------------

def one_time_job(name, max_epochs, trials=1):
    job = synthetic_job(name, seed=3, trials=trials)
    job["workload"]["params"].update(
        train_samples=256, val_samples=64,
        # Eager epochs sleep 0.8 s; compiled ones 0.1 s after a 1.2 s compile, paid once
        # per trial: worth it from the second compiled epoch on.
        cost_by_knob={"compile": {"false": 0.8, "true": 0.1}},
        one_time_by_knob={"compile": {"true": 1.2}},
    )
    job["system"] = {"default": {"cores": 1}, "space": {"compile": [False, True]}}
    # What this compile costs and saves, said as a user who measured it would (the
    # priors are a real compile's: 20 s, which these sleeps never pay back).
    job["pipetune"] = {"one_time_price_s": 1.2, "one_time_saving": 0.8}
    job["early_stopping"] = {"policy": "none", "max_epochs": max_epochs}
    return job


def run_job(tmp_path, job, gt=None):
    spec = JobSpec.from_dict(job, machine=MACHINE)
    study = Study(spec, study_id=job["name"], checkpoints=CheckpointStore(tmp_path / "ck"),
                  ground_truth=gt, core_budget=1, machine=MACHINE)
    return run_study_locally(study)


def test_a_study_compiles_the_trial_that_can_earn_it_back_and_not_the_short_one(tmp_path):
    long = run_job(tmp_path / "long", one_time_job("long", max_epochs=4))
    trial = long.trials[0]
    assert [(r.phase.value, r.system.compile) for r in trial.results] == [
        ("profile", False), ("probe", True), ("train", True), ("train", True)]
    probe = trial.results[1].measurement
    assert probe.one_time_s == pytest.approx(1.2, abs=0.35)   # the known compile
    assert trial.history[1].steady < trial.history[0].steady / 2
    short = run_job(tmp_path / "short", one_time_job("short", max_epochs=2))
    assert [r.system.compile for r in short.trials[0].results] == [False, False]
    assert "not probed" in short.trials[0].decisions[-1].reason


def test_the_ground_truth_carries_the_compile_to_a_recurring_job_without_a_probe(tmp_path):
    gt = GroundTruth(tmp_path / "gt.json")
    first = run_job(tmp_path / "a", one_time_job("first", max_epochs=4), gt)
    assert first.trials[0].remembered == COMPILED
    (entry,) = gt.entries()
    assert entry.config == COMPILED and entry.one_time == pytest.approx(1.2, abs=0.35)
    assert entry.speedup > 2
    again = run_job(tmp_path / "b", one_time_job("again", max_epochs=3), gt)
    trial = again.trials[0]
    assert trial.match is not None and trial.match.hit
    # No probe: two sure epochs at the recorded speed-up earn the recorded compile back.
    assert [(r.phase.value, r.system.compile) for r in trial.results] == [
        ("profile", False), ("train", True), ("train", True)]
    # What the reused compile cost this time is recorded too: the figures follow what
    # trials pay now (a warm compile cache), not only what the first one paid.
    assert trial.remembered == COMPILED
    (entry,) = gt.entries()
    assert entry.support == 2 and entry.one_time == pytest.approx(1.2, abs=0.35)


# -- real compile: checkpoints move between compiled and eager -----------------------------

def test_a_compiled_trials_checkpoint_is_an_eager_one_and_continues_either_way(tmp_path):
    from pipetune.system.apply import applied_context
    from pipetune.workloads import resolve_workload

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    make = resolve_workload("synthetic")
    hparams, params = {"lr": 0.05, "batch_size": 64}, {"train_samples": 256, "val_samples": 64}

    class Compiling(make):  # the synthetic model, really compiled (not simulated)
        def _step_model(self, model, ctx):
            return ctx.training_model(model)

    compiled = Compiling(**params)
    compiled.setup(hparams, seed=7)
    eager = make(**params)
    eager.setup(hparams, seed=7)
    compiled.train_epoch(applied_context(COMPILED))
    eager.train_epoch(applied_context(DEFAULT))
    state = compiled.state_dict()
    assert set(state["model"]) == set(eager.state_dict()["model"])
    assert not any(k.startswith("_orig_mod.") for k in state["model"])
    for a, b in zip(state["model"].values(), eager.state_dict()["model"].values(), strict=True):
        assert (a - b).abs().max().item() < 1e-4  # the same training, compiled
    CheckpointStore.save(compiled, str(tmp_path / "c.pt"))
    resumed = make(**params)          # compiled checkpoint, continued eagerly
    resumed.setup(hparams, seed=7)
    CheckpointStore.load(resumed, str(tmp_path / "c.pt"))
    assert resumed.epoch == 1
    assert resumed.train_epoch(applied_context(DEFAULT)).samples == 256
    CheckpointStore.save(eager, str(tmp_path / "e.pt"))
    back = Compiling(**params)        # eager checkpoint, continued compiled
    back.setup(hparams, seed=7)
    CheckpointStore.load(back, str(tmp_path / "e.pt"))
    stats = back.train_epoch(applied_context(COMPILED))
    assert back.epoch == 2 and stats.samples == 256 and stats.loss == stats.loss
    # Nothing compiled is left on the model: it still copies and pickles.
    import copy
    import pickle

    model = back._require_setup()[0]
    assert copy.deepcopy(model).state_dict().keys() == model.state_dict().keys()
    assert pickle.loads(pickle.dumps(model)).state_dict().keys() == model.state_dict().keys()


def test_bf16_and_channels_last_train_on_the_cpu_where_bf16_is_native():
    if not MachineInfo.detect().cpu_bf16:
        pytest.skip("this processor has no native bf16")
    from pipetune.system.apply import applied_context
    from pipetune.workloads import resolve_workload

    w = resolve_workload("lenet5")(train_samples=128, val_samples=64)
    w.setup({"lr": 0.05, "batch_size": 32}, seed=1)
    ctx = applied_context(DEFAULT.replace(precision="bf16", channels_last=True))
    stats = w.train_epoch(ctx)
    assert stats.samples == 128 and stats.loss == stats.loss
    assert 0.0 <= w.evaluate(ctx)["accuracy"] <= 1.0


def test_bf16_on_a_cpu_without_it_is_refused_before_anything_is_recorded(tmp_path):
    job = one_time_job("bf16", max_epochs=2)
    job["system"] = {"default": {"cores": 1, "precision": "bf16"}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PIPETUNE_HOME=str(tmp_path / "home"), PIPETUNE_CPUINFO=str(cpuinfo))
    proc = subprocess.run([sys.executable, "-m", "pipetune", "tune", str(path)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    # The server starts while the job is checked; the refusal is one line.
    (line,) = [x for x in proc.stderr.splitlines() if not x.startswith("starting a local")]
    assert line.startswith("error:")
    assert "system.default.precision" in line and "avx512_bf16 or amx_bf16" in line
    assert not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "home" / "studies").exists()


# -- the machine, not only the trial --------------------------------------------------------

def wall_obs(epoch, phase, system, wall_per_sample):
    steady = wall_per_sample * system.cores  # core-seconds, as a study running side by side
    return EpochObservation(epoch, phase, system, cost=steady, steady=steady,
                            samples=SAMPLES, wall_steady=wall_per_sample)


def test_a_trial_alone_takes_the_idle_cores_only_if_its_own_wall_time_says_it_goes_faster():
    tuner = SystemTuner(DEFAULT, {"channels_last": [True]}, machine=MACHINE)
    two = DEFAULT.replace(cores=2)
    history = [wall_obs(1, "profile", DEFAULT, 0.010), wall_obs(2, "train", DEFAULT, 0.010)]
    # With others waiting for cores there is nothing idle to take.
    assert tuner.next_epoch(history, epochs_left=5, match=None).system == DEFAULT
    tried = tuner.next_epoch(history, epochs_left=5, match=None, alone_cores=2)
    # Training, measured: not a probe of the plan, so never recorded as the trial's pick.
    assert tried.phase is Phase.TRAIN and tried.system == two and "try cores=2" in tried.reason
    assert tuner.next_epoch(history, epochs_left=1, match=None, alone_cores=2).system == DEFAULT
    # Never more than one epoch can claim (a team stack's 1-core workers).
    small = SystemTuner(DEFAULT, {"channels_last": [True]}, machine=MachineInfo(cores=1))
    assert small.next_epoch(history, epochs_left=5, match=None, alone_cores=2).system == DEFAULT
    # 1.6x faster in wall time (though 1.25x dearer in core-seconds): keep both cores.
    faster = [*history, wall_obs(3, "train", two, 0.00625)]
    kept = tuner.next_epoch(faster, epochs_left=4, match=None, alone_cores=2)
    assert kept.phase is Phase.TRAIN and kept.system == two
    # Not faster beyond the margin: back to one core, and no second probe.
    same = [*history, wall_obs(3, "train", two, 0.0098)]
    back = tuner.next_epoch(same, epochs_left=4, match=None, alone_cores=2)
    assert back.phase is Phase.TRAIN and back.system == DEFAULT


def test_a_one_time_knob_is_probed_on_top_of_the_best_config_so_far():
    tuner = SystemTuner(DEFAULT, {"channels_last": [True], "compile": [True]}, machine=MACHINE)
    cl = DEFAULT.replace(channels_last=True)
    history = [obs(1, "profile", DEFAULT, 0.010), obs(2, "probe", cl, 0.006)]
    # 6 epochs at the best rate so far (6 s) x 20% = 7.2 s saved > 5 s once.
    decision = tuner.next_epoch(history, epochs_left=6, match=None, sure_epochs=6,
                                one_time_price=OneTimePrice(5.0))
    assert decision.inputs["expected_saving"] == pytest.approx(7.2)
    assert decision.phase is Phase.PROBE and decision.system == cl.replace(compile=True)
    history.append(obs(3, "probe", cl.replace(compile=True), 0.007, one_time=30.0))
    done = tuner.next_epoch(history, epochs_left=5, match=None, sure_epochs=5)
    assert done.phase is Phase.TRAIN and done.system == cl and done.remember == cl


# -- a job the ground truth knows: its first epoch under the known config ---------------------

def channels_last_job(name, **params):
    job = synthetic_job(name, seed=5, trials=1)
    job["workload"]["params"].update(train_samples=256, val_samples=64,
                                     cost_by_knob={"channels_last": {"false": 0.6}}, **params)
    job["system"] = {"default": {"cores": 1}, "space": {"channels_last": [False, True]}}
    job["early_stopping"] = {"policy": "none", "max_epochs": 3}
    return job


class Journal(StudyJournal):
    """The journal at the edge: keeps the events it is told in a list, not a file."""

    def __init__(self):  # noqa: D107 - no folder: nothing is written
        self.events = []

    def append(self, kind, trial, data):
        self.events.append((kind, trial, data))


def test_a_known_job_runs_its_first_epoch_under_the_known_config_and_confirms_it(tmp_path):
    gt = GroundTruth(tmp_path / "gt.json")
    # A sleep under every config: the known cost is confirmed within its margin, and an
    # epoch of a tiny MLP alone (milliseconds) is not at the mercy of a loaded machine.
    first = run_job(tmp_path / "a", channels_last_job("cl", base_seconds=0.2), gt)
    cl = DEFAULT.replace(channels_last=True)
    assert [r.system for r in first.trials[0].results] == [DEFAULT, cl, cl]
    # The refit the first study's memory started runs in this process (a study run
    # here, not on workers): wait for it rather than share the next epoch with it.
    gt.prepare()
    again = run_job(tmp_path / "b", channels_last_job("cl", base_seconds=0.2), gt)
    trial = again.trials[0]
    assert trial.match.known_graph == first.trials[0].results[0].graph != ""
    assert [(r.phase.value, r.system) for r in trial.results] == [
        ("profile", cl), ("train", cl), ("train", cl)]
    assert "known job" in trial.decisions[0].reason
    # Another model (a different int hyperparameter shapes it) is another job.
    other = run_job(tmp_path / "c", channels_last_job("cl", base_seconds=0.2, features=24), gt)
    assert other.trials[0].results[0].system == DEFAULT


def test_a_known_job_whose_first_epoch_does_not_confirm_starts_over_from_the_default(tmp_path):
    from pipetune.engine.trial import Trial

    gt = GroundTruth(tmp_path / "gt.json")
    job = channels_last_job("graph")
    spec = JobSpec.from_dict(job, machine=MACHINE)
    probe = Study(spec, study_id="k", checkpoints=CheckpointStore(tmp_path / "k"),
                  machine=MACHINE)
    key = probe.job_key(Trial(trial_id=0, params={"lr": 0.05}, seed=0))
    seeded = Study(JobSpec.from_dict(channels_last_job("seed"), machine=MACHINE),
                   study_id="seed", checkpoints=CheckpointStore(tmp_path / "a"),
                   ground_truth=GroundTruth(tmp_path / "x.json"), core_budget=1,
                   machine=MACHINE)
    profiles = []  # as the study's observers see it (an ended trial keeps no profile)
    seeded.observe(lambda e: profiles.append(e.result.measurement.profile)
                   if e.name == "epoch_finished" and e.result.epoch == 1 else None)
    run_study_locally(seeded)
    profile = profiles[0]
    cl = DEFAULT.replace(channels_last=True)
    gt.remember(profile, 32, "time", cl, 1e-4, job_key=key, graph="another-graph")
    study = Study(spec, study_id="graph", checkpoints=CheckpointStore(tmp_path / "ck"),
                  ground_truth=gt, core_budget=1, machine=MACHINE, journal=Journal())
    run_study_locally(study)
    trial = study.trials[0]
    assert [(r.phase.value, r.system) for r in trial.results[:2]] == [
        ("profile", cl), ("profile", DEFAULT)]
    (why,) = [d for k, _, d in study.journal.events if k == "unconfirmed"]
    assert "is not the known job's another-graph" in why
    assert trial.baseline == 1 and trial.match is not None and not trial.match.known_graph


def test_a_reused_compile_is_weighed_against_the_trials_own_rate_without_it():
    cl = DEFAULT.replace(channels_last=True)
    both = cl.replace(compile=True)
    tuner = SystemTuner(DEFAULT, {"channels_last": [True], "compile": [True]}, machine=MACHINE)
    # Recorded: compile on top of channels_last is 1.25x, for 3 s once.
    match = hit(3.0, 1.25, config=both)
    history = [obs(1, "profile", DEFAULT, 0.010)]
    first = tuner.next_epoch(history, epochs_left=8, match=match, sure_epochs=2)
    assert first.system == cl and "first, to weigh compile" in first.reason
    history.append(obs(2, "train", cl, 0.006))
    # 0.006 x 1000 x (1 - 1/1.25) = 1.2 s saved per epoch: 2 epochs do not pay 3 s, 3 do.
    short = tuner.next_epoch(history, epochs_left=7, match=match, sure_epochs=2)
    assert short.system == cl and short.inputs["gain"] == pytest.approx(2.4)
    long = tuner.next_epoch(history, epochs_left=7, match=match, sure_epochs=3)
    assert long.system == both and long.inputs["gain"] == pytest.approx(3.6)


def test_recurring_slow_steps_stay_in_the_steady_rate_a_rare_one_is_one_time():
    import time

    from pipetune.profiler import EpochProfiler
    from pipetune.workloads import TrainStats

    def epoch(slow_every, first_s=0.0):
        def train(hook):
            for i in range(60):
                time.sleep(first_s if i == 0 else (0.03 if slow_every and i % slow_every == 0
                                                   else 0.002))
                hook()
            return TrainStats(loss=0.0, samples=60, steps=60)
        return EpochProfiler(perf="off").measure(train, profile_ops=False)[1]

    once = epoch(0, first_s=0.3)            # one slow first step: a one-time cost
    assert once.one_time_s == pytest.approx(0.3, abs=0.1)
    assert once.steady_step_s < 0.01
    recurring = epoch(5)                    # every 5th step slow: part of the rate
    assert recurring.one_time_s < 0.05
    assert recurring.steady_step_s > 0.006


def test_a_compile_cache_name_stays_inside_the_cache():
    from pipetune.errors import SpecError

    for bad in ("..", "../x", "a/b", ".hidden"):
        job = channels_last_job("cache")
        job["pipetune"] = {"compile_cache": bad}
        with pytest.raises(SpecError, match="pipetune.compile_cache"):
            JobSpec.from_dict(job, machine=MACHINE)
    job["pipetune"] = {"compile_cache": "bench-1.2_x"}
    assert JobSpec.from_dict(job, machine=MACHINE).pipetune.compile_cache == "bench-1.2_x"


def test_a_compile_that_pays_on_one_workload_is_checked_not_trusted_on_a_lookalike(tmp_path):
    """Two jobs of one profile (the same model and data; only the known sleep differs):
    compile pays on the first and loses on the second. The second matches the first's
    cluster, tries the reused compile once, sees it run slower than its own default,
    and drops it."""
    gt = GroundTruth(tmp_path / "gt.json")
    pays = run_job(tmp_path / "a", one_time_job("pays", max_epochs=4), gt)
    assert pays.trials[0].remembered == COMPILED
    loses = one_time_job("loses", max_epochs=4)
    loses["workload"]["params"].update(cost_by_knob={"compile": {"false": 0.6, "true": 1.2}},
                                       one_time_by_knob={"compile": {"true": 0.2}})
    other = run_job(tmp_path / "b", loses, gt)
    trial = other.trials[0]
    assert trial.match is not None and trial.match.hit and trial.match.known_graph is None
    # Projected on its own rate (3 sure epochs x 0.6 s x (1 - 1/7.7) > 1.2 s once), the
    # reused compile is tried once, runs 2x slower than this trial's default, is dropped.
    assert [r.system.compile for r in trial.results] == [False, True, False, False]
    assert "compile pays" in trial.decisions[1].reason
    assert "this trial's default: miss" in trial.decisions[2].reason
    # A lookalike whose default is already fast is not even tried: on its own rate the
    # recorded speed-up saves less than the recorded compile costs (3 x 0.25 s x 0.87 <
    # 1.2 s). Its epochs still sleep most of their time, so its operator mix stays the
    # first job's on a slow machine too (a 0.05 s sleep let training time shift the mix
    # there, and the lookalike missed the cluster and probed).
    fast = one_time_job("fast", max_epochs=4)
    fast["workload"]["params"].update(cost_by_knob={"compile": {"false": 0.25, "true": 0.8}})
    quick = run_job(tmp_path / "c", fast, gt).trials[0]
    assert quick.match is not None and quick.match.hit, quick.match
    assert [r.system.compile for r in quick.results] == [False, False, False, False], [
        d.reason for d in quick.decisions]
    assert "compile does not pay" in quick.decisions[1].reason


# -- weighed by expectation (issue 31) --------------------------------------------------------

def test_asha_expects_each_later_epoch_by_the_promotion_rates_seen_at_its_rungs():
    asha = ASHAScheduler(min_epochs=1, max_epochs=6, reduction_factor=2)
    # Before any trial is decided: ASHA's prior 1/2 per rung (rungs 1, 2, 4).
    assert asha.expected_epochs(1) == pytest.approx(1 + 0.5 + 0.5 + 0.25 + 0.25)
    assert asha.sure_epochs(1) == 1
    for trial, value in enumerate([0.9, 0.1, 0.05]):  # one goes on past rung 2, two stop
        asha.on_epoch_result(trial, 1, 1.0)
        asha.on_epoch_result(trial, 2, value)
    assert asha.promotion_rate(2) == pytest.approx((1 + 0.5) / (3 + 1))
    assert asha.expected_epochs(1) == pytest.approx(1 + 0.375 + 0.375 + 0.1875 + 0.1875)
    # Past the last rung every epoch is sure.
    assert asha.expected_epochs(4) == pytest.approx(2.0)


def test_an_unknown_one_time_knob_is_weighed_against_the_expected_epochs_not_the_sure_ones():
    tuner = SystemTuner(DEFAULT, {"compile": [False, True]}, machine=MACHINE)
    first = [obs(1, "profile", DEFAULT, 0.05)]    # 50 s epochs
    # ASHA by 2: never sure of 3 more epochs, but expected to run 3.2 of them: 3.2 x 50 s
    # x 20% = 32 s saved > 20 s once.
    probed = tuner.next_epoch(first, epochs_left=5, match=None, sure_epochs=1,
                              expected_epochs=3.2)
    assert probed.phase is Phase.PROBE and probed.system == COMPILED
    assert probed.inputs == {"expected_epochs": 3.2, "sure_epochs": 1,
                             "one_time_price": 20.0, "expected_saving": 32.0,
                             "saving_share": 0.2, "price_from": "prior"}
    short = tuner.next_epoch(first, epochs_left=5, match=None, sure_epochs=1,
                             expected_epochs=1.8)
    assert short.system == DEFAULT
    assert "1.8 expected epoch(s) < 2 to earn a one-time cost back" in short.reason
    # Shorter epochs (30 s): 2.4 expected of them save 14.4 s, under the price.
    mid = tuner.next_epoch([obs(1, "profile", DEFAULT, 0.03)], epochs_left=5, match=None,
                           sure_epochs=1, expected_epochs=2.4)
    assert mid.system == DEFAULT
    assert ("compile=True not probed: saves ~14.4 over 2.4 expected epoch(s) at 20% <= 20 "
            "once (prior)") in mid.reason


@pytest.mark.parametrize(("expected", "worker_one_time", "probed"), [
    (2.0, 0.0, True),     # the worker compiled this graph before: an ordinary probe
    (1.5, 0.0, False),    # ... but a probe needs an epoch after it to pay
    (2.0, 5.0, False),    # 5 s once: 2 epochs of 10 s save 4 s at the prior 20%
    (3.0, 5.0, True),     # ... 3 save 6 s
])
def test_a_compile_the_worker_already_paid_is_probed_like_any_knob(expected, worker_one_time,
                                                                   probed):
    tuner = SystemTuner(DEFAULT, {"compile": [False, True]}, machine=MACHINE)
    first = [obs(1, "profile", DEFAULT, 0.01)]   # 10 s epochs
    decision = tuner.next_epoch(first, epochs_left=5, match=None, sure_epochs=1,
                                expected_epochs=expected, known_one_time=worker_one_time)
    assert (decision.system == COMPILED) is probed
    assert decision.inputs["worker_one_time"] == worker_one_time


def test_a_known_compile_is_weighed_against_what_the_worker_pays_not_what_was_recorded():
    tuner = SystemTuner(DEFAULT, {"compile": [True]}, machine=MACHINE)
    history = [obs(1, "profile", DEFAULT, 0.01)]
    # Recorded: 8 s once, 2x. One expected epoch saves 5 s: not enough for 8 s ...
    recorded = tuner.next_epoch(history, epochs_left=8, match=hit(8.0, 2.0), sure_epochs=1,
                                expected_epochs=1.0)
    assert recorded.system == DEFAULT and "does not pay" in recorded.reason
    # ... but this worker compiled the graph already: 0.3 s once.
    reused = tuner.next_epoch(history, epochs_left=8, match=hit(8.0, 2.0), sure_epochs=1,
                              expected_epochs=1.0, known_one_time=0.3)
    assert reused.system == COMPILED and "0.3 once on this worker" in reused.reason
    assert reused.inputs["one_time"] == 0.3 and reused.inputs["recorded_one_time"] == 8.0


def worker_compile_job(name, scope):
    job = one_time_job(name, max_epochs=4, trials=3)
    # Eager 0.3 s, compiled 0.1 s after 1.2 s once: over 3 epochs a compile saves 0.6 s,
    # so the recorded 1.2 s never pays for a recurring trial; one already paid does.
    job["workload"]["params"].update(cost_by_knob={"compile": {"false": 0.3, "true": 0.1}},
                                     one_time_scope=scope)
    # The job's stated price is too low (0.5 s): the first trial probes, pays 1.2 s, and
    # what it paid is the study's price from then on.
    job["pipetune"]["one_time_price_s"] = 0.5
    return job


def test_a_later_trial_compiles_on_the_worker_that_paid_and_learns_what_a_reuse_costs(
        tmp_path):
    from pipetune.workloads import synthetic

    synthetic._PROCESS_PAID.clear()
    reused = run_job(tmp_path / "process", worker_compile_job("process", "process"),
                     GroundTruth(tmp_path / "gt1.json"))
    compiled = [[r.system.compile for r in t.results] for t in reused.trials.values()]
    assert compiled == [[False, True, True, True], [False, True, True, True],
                        [False, True, True, True]]
    later = reused.trials[1]
    assert later.decisions[1].inputs["worker_one_time"] == 0.0
    assert "on this worker" in later.decisions[1].reason
    assert later.history[1].one_time < 0.5          # it really paid (about) nothing
    # A workload that pays its compile again for every trial: the second trial, told a
    # reuse costs nothing, pays 1.2 s, and the third is told what it measured.
    fresh = run_job(tmp_path / "trial", worker_compile_job("trial", "trial"),
                    GroundTruth(tmp_path / "gt2.json"))
    compiled = [[r.system.compile for r in t.results] for t in fresh.trials.values()]
    assert compiled[1] == [False, True, True, True]
    assert fresh.trials[1].history[1].one_time == pytest.approx(1.2, abs=0.35)
    assert compiled[2] == [False, False, False, False]
    assert fresh.trials[2].decisions[1].inputs["worker_one_time"] == pytest.approx(1.2,
                                                                                    abs=0.35)


def test_the_slots_busy_share_counts_epochs_held_until_the_tail(tmp_path):
    from pipetune.engine.events import EpochFinished
    from pipetune.reports import slots_busy

    def busy_share(name, driver_pause_s):
        job = synthetic_job(name, trials=3)
        job["workload"]["params"]["base_seconds"] = 0.3
        spec = JobSpec.from_dict(job, machine=MACHINE)
        study = Study(spec, study_id=name, checkpoints=CheckpointStore(tmp_path / name),
                      core_budget=1, machine=MACHINE)
        # A driver that takes driver_pause_s to act on each finished epoch.
        study.observe(lambda e: isinstance(e, EpochFinished) and time.sleep(driver_pause_s))
        return run_study_locally(study)

    quick = busy_share("quick", 0.0)
    busy = quick.summary().slots_busy
    assert busy == slots_busy(quick) and busy > 0.8
    assert quick.summary().to_metrics()["slots_busy"] == busy
    # Each epoch followed by 0.6 s of the driver: the slot is held epoch / (epoch + 0.6).
    slow = busy_share("slow", 0.6)
    epochs = [r.finished - r.started for t in slow.trials.values() for r in t.results]
    epoch = sum(epochs) / len(epochs)
    assert slow.summary().slots_busy == pytest.approx(epoch / (epoch + 0.6), abs=0.08)


def test_an_unknown_one_time_knob_is_not_probed_beside_a_trial_probing_it():
    tuner = SystemTuner(DEFAULT, {"compile": [False, True]}, machine=MACHINE)
    first = [obs(1, "profile", DEFAULT, 0.05)]    # 4 expected epochs of 50 s would pay
    beside = tuner.next_epoch(first, epochs_left=5, match=None, sure_epochs=1,
                              expected_epochs=4.0, probed_elsewhere=True)
    assert beside.system == DEFAULT and "another trial is probing it now" in beside.reason
    # A compile this worker paid already is cheap: no reason to wait for the other trial.
    cheap = tuner.next_epoch(first, epochs_left=5, match=None, sure_epochs=1,
                             expected_epochs=4.0, known_one_time=0.0, probed_elsewhere=True)
    assert cheap.system == COMPILED


def test_an_untried_compile_is_priced_by_this_study_then_the_ground_truth_then_the_prior(
        tmp_path):
    from known import CONV_JOB, DENSE_JOB, noisy

    from pipetune.engine.one_time import OneTimeLedger

    gt = GroundTruth(tmp_path / "gt.json")
    spec = JobSpec.from_dict(one_time_job("priced", max_epochs=4), machine=MACHINE)
    ledger = OneTimeLedger.for_study(spec, gt)
    # Nothing measured: the job's stated prior (the built-in one where it states none).
    assert ledger.price() == OneTimePrice(None, 0.8, "prior", prior_s=1.2)
    bare = JobSpec.from_dict(synthetic_job("bare"), machine=MACHINE)
    assert OneTimeLedger.for_study(bare, gt).price() == OneTimePrice(
        None, ONE_TIME_SAVING_PRIOR, "prior", prior_s=ONE_TIME_PRICE_PRIOR_S)
    # Two other jobs compiled on this machine. One, a trial at a time (seconds), paid
    # 30 s first (then 2 s, its cache warm), 2x faster; the other, side by side on 2
    # cores (core-seconds), 20 core-s = 10 s, 1.25x faster. A config without a one-time
    # knob, another objective, and a record without figures say nothing of compiles.
    conv, dense = noisy(CONV_JOB, 1), noisy(DENSE_JOB, 2)
    two_cores = COMPILED.replace(cores=2)
    gt.remember(conv, 32, "time", COMPILED, 0.01, job_key="conv", one_time=30.0,
                speedup=2.0, cost_unit="seconds")
    gt.remember(conv, 32, "time", COMPILED, 0.01, job_key="conv", one_time=2.0,
                speedup=2.0, cost_unit="seconds")
    gt.remember(dense, 32, "time", two_cores, 0.01, job_key="dense", one_time=20.0,
                speedup=1.25, cost_unit="core_seconds")
    gt.remember(dense, 32, "time", DEFAULT.replace(cores=2), 0.01, job_key="dense",
                one_time=99.0, speedup=1.5, cost_unit="core_seconds")
    gt.remember(dense, 32, "energy", COMPILED, 0.01, job_key="energy", one_time=99.0,
                speedup=9.0, cost_unit="joules")
    gt.remember(dense, 32, "time", COMPILED, 0.01, job_key="bare", cost_unit="seconds")
    price, saving, jobs = gt.one_time_figures("time")
    assert (price, jobs) == (20.0, 2)                       # median of 30 s and 10 s
    # (plain arithmetic: pytest.approx reads numpy, which the store's background fit may
    # be importing right now)
    assert abs(saving - 0.35) < 1e-9                        # median of 0.5 and 0.2
    price = OneTimeLedger.for_study(spec, gt).price()
    assert (price.price, price.source, price.prior_s) == (20.0, "ground truth, 2 job(s)", 1.2)
    assert abs(price.saving - 0.35) < 1e-9
    # Energy: a saving is known, no price in seconds (joules only): the prior's, with it.
    energy = gt.one_time_figures("energy")
    assert energy[0] is None and energy[2] == 1
    # This study paid a first compile itself, 8 core-seconds on 2 cores: its own
    # price, 4 wall seconds, and the machine's saving.
    ledger = OneTimeLedger.for_study(spec, gt)
    ledger.paid("tcp://w1", "g", 64, ("compile",), 8.0, per_wall_s=2.0)
    assert ledger.price().price == 4.0 and ledger.price().source == "this study's 1 first(s)"
    assert abs(ledger.price().saving - 0.35) < 1e-9


def test_a_price_in_wall_seconds_is_paid_in_the_trials_own_units():
    tuner = SystemTuner(DEFAULT, {"cores": [2], "compile": [True]}, machine=MACHINE)
    wide = DEFAULT.replace(cores=2)

    def seen(epoch, phase, system, steady, wall):
        return EpochObservation(epoch, phase, system, cost=steady, steady=steady,
                                samples=SAMPLES, wall_steady=wall)

    # Core-seconds: the default's 1 core, 20 s a 1,000-sample epoch; 2 cores are 1.25x
    # cheaper in core-seconds (16 core-s: 8 s of wall x 2 cores). A compile on top of
    # them holds 2 cores for its price: 10 wall seconds cost 20 core-seconds.
    history = [seen(1, "profile", DEFAULT, 0.02, 0.02), seen(2, "probe", wide, 0.016, 0.008)]
    decision = tuner.next_epoch(history, epochs_left=8, match=None, sure_epochs=8,
                                one_time_price=OneTimePrice(10.0, 0.2, "measured"))
    assert decision.inputs["one_time_price"] == 20.0
    assert decision.inputs["expected_saving"] == pytest.approx(8 * 16 * 0.2)
    assert decision.system == wide.replace(compile=True)    # 25.6 > 20
    shorter = tuner.next_epoch(history, epochs_left=6, match=None, sure_epochs=6,
                               one_time_price=OneTimePrice(10.0, 0.2, "measured"))
    assert shorter.system == wide                           # 19.2 <= 20


def test_a_compile_the_worker_paid_is_probed_even_where_the_machine_saw_no_saving():
    tuner = SystemTuner(DEFAULT, {"compile": [False, True]}, machine=MACHINE)
    first = [obs(1, "profile", DEFAULT, 0.01)]
    none = OneTimePrice(None, 0.0, "ground truth, 3 job(s)")
    assert tuner.next_epoch(first, epochs_left=5, match=None, sure_epochs=5,
                            one_time_price=none).system == DEFAULT
    # Paid on this worker already: probing it costs nothing, and this job may differ.
    paid = tuner.next_epoch(first, epochs_left=5, match=None, sure_epochs=5,
                            known_one_time=0.0, one_time_price=none)
    assert paid.system == COMPILED


def test_a_first_compile_on_a_worker_counts_what_later_trials_there_would_save():
    tuner = SystemTuner(DEFAULT, {"compile": [False, True]}, machine=MACHINE)
    first = [obs(1, "profile", DEFAULT, 0.01)]    # 10 s epochs
    # This trial alone: 3 expected epochs save 6 s, under the 20 s prior ...
    alone = tuner.next_epoch(first, epochs_left=5, match=None, sure_epochs=1,
                             expected_epochs=3.0)
    assert alone.system == DEFAULT
    # ... but 8 more epochs of later trials on this worker would reuse the compile:
    # (3 + 8) x 10 s x 20% = 22 s > 20 s.
    shared = tuner.next_epoch(first, epochs_left=5, match=None, sure_epochs=1,
                              expected_epochs=3.0, reuse_epochs=8.0)
    assert shared.phase is Phase.PROBE and shared.system == COMPILED
    assert shared.inputs["later_trials_epochs"] == 8.0
    assert shared.inputs["expected_saving"] == pytest.approx(22.0)
    assert "3 expected epoch(s) and 8 of later trials on this worker" in shared.reason
    # A worker that paid already says what a reuse costs it: later trials are no
    # reason to pay 5 s again (3 epochs save 6 s > 5 s; with 2, 4 s does not).
    paid = tuner.next_epoch(first, epochs_left=5, match=None, sure_epochs=1,
                            expected_epochs=2.0, known_one_time=5.0, reuse_epochs=8.0)
    assert paid.system == DEFAULT and "later_trials_epochs" not in paid.inputs
    # The trial itself must still run an epoch after the probe.
    last = tuner.next_epoch(first, epochs_left=1, match=None, sure_epochs=1,
                            expected_epochs=1.0, reuse_epochs=100.0)
    assert last.system == DEFAULT


def test_later_trials_count_only_where_every_trial_builds_the_same_graph():
    from pipetune.engine.one_time import later_epochs_per_slot, one_graph_for_every_trial
    from pipetune.schedulers import ASHAScheduler

    def spec(**space):
        job = synthetic_job("graphs", trials=8)
        job["hyperparameters"] = {"hidden": {"type": "choice", "values": [16]}, **space}
        job["search"]["max_concurrent"] = 2
        return JobSpec.from_dict(job, machine=MACHINE)

    asha = ASHAScheduler(min_epochs=1, max_epochs=6, reduction_factor=2)
    # A rate (a float, even as a choice) and one batch size: one graph.
    same = spec(batch_size={"type": "choice", "values": [64]},
                lr={"type": "choice", "values": [0.01, 0.1]})
    assert one_graph_for_every_trial(same)
    # 6 trials left, each expected to run 1/2 + 1/4 + 1/4 + 1/8 + 1/8 = 1.25 epochs
    # after its profiled first (ASHA by 2's prior: 1/2 past each of rungs 1, 2 and 4),
    # over 2 slots.
    assert later_epochs_per_slot(same, asha, 6) == pytest.approx(6 * 1.25 / 2)
    assert later_epochs_per_slot(same, asha, 0) == 0.0
    for shaping in ({"batch_size": {"type": "choice", "values": [32, 64]}},
                    {"hidden": {"type": "int", "low": 8, "high": 32}},
                    {"hidden": {"type": "choice", "values": [16.0, 32]}}):
        other = spec(**shaping)
        assert not one_graph_for_every_trial(other)
        assert later_epochs_per_slot(other, asha, 6) == 0.0

    class Unsure(ASHAScheduler):
        """A scheduler of a user's that cannot say how long a trial runs."""

        def expected_epochs(self, epochs_run):
            return math.inf

    assert later_epochs_per_slot(same, Unsure(min_epochs=1, max_epochs=6,
                                              reduction_factor=2), 6) == 0.0


def test_a_study_weighs_a_first_compile_with_the_trials_a_grid_has_left(tmp_path):
    job = one_time_job("grid", max_epochs=4, trials=20)
    job["hyperparameters"] = {"lr": {"type": "choice", "values": [0.01, 0.05, 0.1]}}
    job["search"].update(algorithm="grid")
    study = run_job(tmp_path, job)
    assert len(study.trials) == 3                      # the grid holds 3, not 20
    first = study.trials[0].decisions[1]
    # 2 trials left of the grid (not 19), 3 epochs each after the first, one slot.
    assert first.inputs["later_trials_epochs"] == 6.0
    assert first.inputs["price_from"] == "prior"
    assert "and 6 of later trials on this worker" in first.reason
    last = study.trials[2].decisions[1]
    assert "later_trials_epochs" not in last.inputs
