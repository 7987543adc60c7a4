"""The system tuner on known cost models, with a real ground truth in a temp folder."""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable

import pytest
from known import CONV_JOB, DENSE_JOB, noisy

from pipetune.errors import SpecError, SystemConfigError
from pipetune.groundtruth import GroundTruth
from pipetune.profiler.profile import Profile
from pipetune.system.config import MachineInfo, SystemConfig
from pipetune.tuner import (
    EpochObservation,
    GroundTruthMatch,
    Phase,
    SystemTuner,
    TuningDecision,
)

TWO_CORES = MachineInfo(cores=2)
DEFAULT = SystemConfig(cores=1)
SPACE = {"cores": [1, 2], "dataloader_workers": [0, 1]}


def known_cost(config: SystemConfig) -> float:
    """cores=1: 3.0 s/sample, cores=2: 1.0; one loader worker adds 0.5 (it only steals a core)."""
    cost = {1: 3.0, 2: 1.0}[config.cores]
    return cost + (0.5 if config.dataloader_workers == 1 else 0.0)


CNN, MLP = CONV_JOB, DENSE_JOB


def profile_of(job: dict[str, float], seed: int) -> Profile:
    """The job's profile with run-to-run noise well under the ground truth's scale floors."""
    return noisy(job, seed)


def run_trial(
    tuner: SystemTuner,
    gt: GroundTruth,
    profile: Profile,
    *,
    epochs: int,
    cost: Callable[[SystemConfig], float] = known_cost,
    batch_size: int = 32,
) -> tuple[list[EpochObservation], list[TuningDecision], GroundTruthMatch | None]:
    """Drive one trial the way the study engine does: decide, record if told, run, observe;
    look the epoch-1 profile up; ask once more with ``epochs_left=0`` at the end."""
    history: list[EpochObservation] = []
    decisions: list[TuningDecision] = []
    match: GroundTruthMatch | None = None
    for epoch in range(1, epochs + 1):
        decision = tuner.next_epoch(history, epochs_left=epochs - len(history), match=match)
        decisions.append(decision)
        if decision.remember is not None:
            gt.remember(profile, batch_size, "time", decision.remember, decision.remember_cost)
        history.append(
            EpochObservation(epoch, decision.phase, decision.system, cost(decision.system))
        )
        if epoch == 1:
            match = gt.lookup(profile, batch_size, "time")
    final = tuner.next_epoch(history, epochs_left=0, match=match)
    decisions.append(final)
    if final.remember is not None:
        gt.remember(profile, batch_size, "time", final.remember, final.remember_cost)
    return history, decisions, match


@pytest.fixture
def gt(tmp_path) -> GroundTruth:
    return GroundTruth(tmp_path / "gt.json")


def test_one_knob_plan_in_knob_order_default_excluded_invalid_dropped():
    tuner = SystemTuner(
        DEFAULT,
        # Written out of field order, with values the machine or the default cannot take.
        {"dataloader_workers": [1, 0, 2], "precision": ["bf16"], "cores": [4, 2, 1]},
        machine=TWO_CORES,
    )
    assert [c.label() for c in tuner.candidates()] == [
        "cores=2 interop=1 workers=0",
        "cores=1 interop=1 workers=1",
        "cores=1 interop=1 workers=2",
    ]
    assert DEFAULT not in tuner.candidates()
    assert any(d.startswith("cores=4") for d in tuner.dropped)
    assert any(d.startswith("precision='bf16'") for d in tuner.dropped)
    capped = SystemTuner(DEFAULT, SPACE, machine=TWO_CORES, max_probes=1)
    assert capped.candidates() == [SystemConfig(cores=2)]


def test_cuda_candidates_need_a_gpu():
    space = {"device": ["cuda"]}
    assert SystemTuner(DEFAULT, space, machine=TWO_CORES).candidates() == []
    with_gpu = SystemTuner(DEFAULT, space, machine=MachineInfo(cores=2, cuda_devices=1))
    assert with_gpu.candidates() == [SystemConfig(cores=1, device="cuda")]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"space": {"threads": [1]}}, "system.space.threads"),
        ({"space": {"cores": [0]}}, "system.space.cores"),
        ({"space": {"cores": []}}, "system.space.cores"),
        ({"space": {"precision": ["fp8"]}}, "system.space.precision"),
        ({"plan": "grid"}, "pipetune.probe_plan"),
        ({"max_probes": -1}, "pipetune.max_probes"),
        ({"default": SystemConfig(cores=3)}, "system.default.cores"),
    ],
)
def test_bad_settings_name_the_field(kwargs, field):
    args = {"default": DEFAULT, "space": SPACE, **kwargs}
    default, space = args.pop("default"), args.pop("space")
    with pytest.raises(SpecError) as info:
        SystemTuner(default, space, machine=TWO_CORES, **args)
    assert info.value.field == field


def test_miss_probes_each_candidate_then_trains_under_the_cheapest_and_records_it(gt):
    tuner = SystemTuner(DEFAULT, SPACE, machine=TWO_CORES)
    history, decisions, match = run_trial(tuner, gt, profile_of(CNN, 1), epochs=5)

    assert match is not None and not match.hit
    assert [d.phase for d in decisions[:5]] == [
        Phase.PROFILE,
        Phase.PROBE,
        Phase.PROBE,
        Phase.TRAIN,
        Phase.TRAIN,
    ]
    probed = [o.system for o in history if o.phase is Phase.PROBE]
    assert probed == tuner.candidates()  # planned equals actual
    assert decisions[1].reason.startswith("probe 1/2: cores=2")
    assert decisions[2].reason == "probe 2/2: dataloader_workers=1"
    assert [o.system for o in history[3:]] == [SystemConfig(cores=2)] * 2
    recorded = [d for d in decisions if d.remember is not None]
    assert len(recorded) == 1 and recorded[0] is decisions[3]
    assert recorded[0].remember == SystemConfig(cores=2) and recorded[0].remember_cost == 1.0
    assert decisions[-1].phase is Phase.TRAIN and decisions[-1].remember is None
    assert len(gt) == 1
    assert tuner.best_observed(history) == (SystemConfig(cores=2), 1.0)


def test_similar_job_hits_the_ground_truth_and_probes_nothing(gt):
    tuner = SystemTuner(DEFAULT, SPACE, machine=TWO_CORES)
    run_trial(tuner, gt, profile_of(CNN, 1), epochs=4)

    history, decisions, match = run_trial(tuner, gt, profile_of(CNN, 2), epochs=4)
    assert match is not None and match.hit and match.config == SystemConfig(cores=2)
    assert [o.phase for o in history] == [Phase.PROFILE] + [Phase.TRAIN] * 3
    assert [o.system for o in history[1:]] == [SystemConfig(cores=2)] * 3
    assert all(d.remember is None for d in decisions)
    assert "ground-truth hit" in decisions[1].reason
    assert len(gt) == 1


def test_dissimilar_job_misses_and_probes(gt):
    tuner = SystemTuner(DEFAULT, SPACE, machine=TWO_CORES)
    run_trial(tuner, gt, profile_of(CNN, 1), epochs=4)

    history, _, match = run_trial(tuner, gt, profile_of(MLP, 2), epochs=4)
    assert match is not None and not match.hit and match.distance > match.bound
    assert [o.phase for o in history].count(Phase.PROBE) == 2
    assert len(gt) == 2


def test_fewer_epochs_than_probes_probes_what_fits_and_records_at_the_end(gt):
    space = {"cores": [1, 2], "dataloader_workers": [0, 1, 2]}
    tuner = SystemTuner(DEFAULT, space, machine=TWO_CORES)
    assert len(tuner.candidates()) == 3

    def cost(config: SystemConfig) -> float:
        return known_cost(config.replace(dataloader_workers=min(config.dataloader_workers, 1)))

    history, decisions, _ = run_trial(tuner, gt, profile_of(CNN, 1), epochs=3, cost=cost)
    assert [o.phase for o in history] == [Phase.PROFILE, Phase.PROBE, Phase.PROBE]
    assert [o.system for o in history[1:]] == tuner.candidates()[:2]
    final = decisions[-1]
    assert final.phase is Phase.TRAIN
    assert final.remember == SystemConfig(cores=2) and final.remember_cost == 1.0
    assert tuner.best_observed(history) == (SystemConfig(cores=2), 1.0)
    assert len(gt) == 1


def test_a_trial_stopped_after_profiling_records_nothing(gt):
    tuner = SystemTuner(DEFAULT, SPACE, machine=TWO_CORES)
    history, decisions, _ = run_trial(tuner, gt, profile_of(CNN, 1), epochs=1)
    assert decisions[-1].remember is None and decisions[-1].system == DEFAULT
    assert tuner.best_observed(history) is None
    assert len(gt) == 0


def test_disabled_tuner_trains_under_the_default_everywhere(gt):
    tuner = SystemTuner(DEFAULT, SPACE, machine=TWO_CORES, enabled=False)
    history, decisions, _ = run_trial(tuner, gt, profile_of(CNN, 1), epochs=4)
    assert {(o.phase, o.system) for o in history} == {(Phase.TRAIN, DEFAULT)}
    assert all(d.remember is None for d in decisions)
    assert len(gt) == 0


def test_stored_config_this_machine_cannot_run_is_a_miss(gt):
    big = MachineInfo(cores=8)
    tuner_big = SystemTuner(DEFAULT, {"cores": [8]}, machine=big)
    run_trial(tuner_big, gt, profile_of(CNN, 1), epochs=3, cost=lambda c: 1.0 / c.cores)
    assert gt.entries()[0].config == SystemConfig(cores=8)

    small = SystemTuner(DEFAULT, SPACE, machine=TWO_CORES)
    history, decisions, match = run_trial(small, gt, profile_of(CNN, 2), epochs=4)
    assert match is not None and match.hit and match.config == SystemConfig(cores=8)
    assert "unusable here" in decisions[1].reason
    assert [o.phase for o in history].count(Phase.PROBE) == 2
    assert all(o.system.cores <= 2 for o in history)


def test_no_lookup_counts_as_a_miss():
    tuner = SystemTuner(DEFAULT, SPACE, machine=TWO_CORES)
    history = [EpochObservation(1, Phase.PROFILE, DEFAULT, 3.0)]
    decision = tuner.next_epoch(history, epochs_left=3, match=None)
    assert decision.phase is Phase.PROBE and decision.system == SystemConfig(cores=2)
    missed = GroundTruthMatch.miss("the ground truth has no records yet")
    after_miss = tuner.next_epoch(history, epochs_left=3, match=missed)
    assert (after_miss.phase, after_miss.system) == (decision.phase, decision.system)
    assert "no ground-truth lookup" in decision.reason and "no records yet" in after_miss.reason


@pytest.mark.parametrize(("probe_cost", "kept"), [(0.97, DEFAULT), (0.90, SystemConfig(cores=2))])
def test_default_keeps_its_place_unless_beaten_by_more_than_the_warmup_margin(probe_cost, kept):
    tuner = SystemTuner(DEFAULT, {"cores": [2]}, machine=TWO_CORES)
    history = [
        EpochObservation(1, Phase.PROFILE, DEFAULT, 1.0),
        EpochObservation(2, Phase.PROBE, SystemConfig(cores=2), probe_cost),
    ]
    decision = tuner.next_epoch(history, epochs_left=2, match=None)
    assert decision.phase is Phase.TRAIN
    assert decision.system == kept == decision.remember
    assert decision.remember_cost == (1.0 if kept == DEFAULT else probe_cost)


def test_an_epoch_that_saw_no_samples_loses():
    tuner = SystemTuner(DEFAULT, SPACE, machine=TWO_CORES)
    history = [
        EpochObservation(1, Phase.PROFILE, DEFAULT, 3.0),
        EpochObservation(2, Phase.PROBE, SystemConfig(cores=2), math.inf),
        EpochObservation(3, Phase.PROBE, SystemConfig(dataloader_workers=1), math.nan),
    ]
    assert tuner.best_observed(history) == (DEFAULT, 3.0)


def test_decisions_depend_only_on_history_so_a_retried_trial_replays(gt):
    tuner = SystemTuner(DEFAULT, SPACE, machine=TWO_CORES)
    history, decisions, match = run_trial(tuner, gt, profile_of(MLP, 5), epochs=5)
    fresh = SystemTuner(DEFAULT, SPACE, machine=TWO_CORES)
    for n in range(1, len(history)):
        again = fresh.next_epoch(history[:n], epochs_left=5 - n, match=match)
        assert again == decisions[n]


def test_history_must_be_the_trials_epochs_in_order():
    tuner = SystemTuner(DEFAULT, SPACE, machine=TWO_CORES)
    with pytest.raises(ValueError, match="epochs 1..n"):
        tuner.next_epoch(
            [EpochObservation(2, Phase.PROFILE, DEFAULT, 1.0)], epochs_left=1, match=None
        )
    with pytest.raises(ValueError):
        EpochObservation(0, Phase.PROFILE, DEFAULT, 1.0)
    with pytest.raises(ValueError):
        TuningDecision(DEFAULT, Phase.TRAIN, DEFAULT, None, "record without a cost")


def test_tuner_and_its_values_cross_a_process_boundary():
    tuner = SystemTuner(DEFAULT, SPACE, machine=TWO_CORES)
    clone = pickle.loads(pickle.dumps(tuner))
    assert clone.candidates() == tuner.candidates()
    obs = EpochObservation(1, "profile", DEFAULT, 2)
    assert obs.phase is Phase.PROFILE and isinstance(obs.cost, float)
    assert pickle.loads(pickle.dumps(obs)) == obs
    decision = tuner.next_epoch([obs], epochs_left=2, match=None)
    assert pickle.loads(pickle.dumps(decision)) == decision
    assert Phase("probe") is Phase.PROBE and str(Phase.TRAIN) == "train"


def test_a_config_invalid_in_combination_is_not_a_spec_error():
    # fp16 is a fine value of its knob; with a CPU default it is just not a candidate.
    tuner = SystemTuner(DEFAULT, {"precision": ["fp32", "fp16"]}, machine=TWO_CORES)
    assert tuner.candidates() == []
    with pytest.raises(SystemConfigError):
        DEFAULT.replace(precision="fp16")


def test_cpu_bf16_is_a_candidate_only_where_the_processor_has_native_bf16():
    plain = SystemTuner(DEFAULT, {"precision": ["bf16"]}, machine=TWO_CORES)
    assert plain.candidates() == [] and "native bf16" in plain.dropped[0]
    native = MachineInfo(cores=2, cpu_flags=frozenset({"avx512f", "avx512_bf16"}))
    tuner = SystemTuner(DEFAULT, {"precision": ["bf16"]}, machine=native)
    assert tuner.candidates() == [DEFAULT.replace(precision="bf16")]


def test_end_to_end_with_a_workload_whose_epoch_time_is_known(gt):
    """Real training, real profiler, real ground truth. The synthetic workload sleeps
    0.2 s per epoch with interop_threads=1 (the default), 0.1 s with 3 and not at all
    with 2, so interop_threads=2 is the cheapest config by a wide margin and the tuner
    must find, keep and reuse it. (The knob is chosen because its real effect is nil:
    torch fixes inter-op threads at first use. On a busy 2-core machine, ``cores=2``
    makes this tiny MLP some 50x *slower*, which would swamp the planted costs.)"""
    from pipetune.profiler import EpochProfiler
    from pipetune.system import applied_system_config
    from pipetune.workloads.synthetic import SyntheticWorkload

    params = {"cost_by_knob": {"interop_threads": {"1": 0.2, "3": 0.1}}, "train_samples": 256}
    best = SystemConfig(interop_threads=2)
    profiler = EpochProfiler(perf="off")
    tuner = SystemTuner(DEFAULT, {"interop_threads": [1, 2, 3]}, machine=TWO_CORES)
    assert SyntheticWorkload(**params).sleep_seconds(best) == 0.0
    profiles: dict[int, Profile] = {}

    def trial(seed: int, epochs: int) -> tuple[list[EpochObservation], list[TuningDecision]]:
        workload = SyntheticWorkload(**params)
        workload.setup({"lr": 0.01 * (seed + 1)}, seed=seed)
        history: list[EpochObservation] = []
        decisions: list[TuningDecision] = []
        match = None
        for epoch in range(1, epochs + 1):
            d = tuner.next_epoch(history, epochs_left=epochs - len(history), match=match)
            decisions.append(d)
            if d.remember is not None:
                gt.remember(profiles[seed], workload.batch_size, "time", d.remember,
                            d.remember_cost)
            with applied_system_config(d.system):
                _, m = profiler.measure(
                    lambda hook, s=d.system: workload.train_epoch(s, on_step=hook),
                    profile_ops=epoch == 1,
                )
            history.append(EpochObservation(epoch, d.phase, d.system, m.cost("time")))
            if epoch == 1:
                profiles[seed] = m.profile
                match = gt.lookup(m.profile, workload.batch_size, "time")
        return history, decisions

    # Warm the process up first, as a long-lived worker is: a process's very first epoch
    # faults in pages and pays one-time CPU costs that make its profile an outlier.
    trial(99, 1)

    history, decisions = trial(0, 4)
    assert [o.phase for o in history] == [Phase.PROFILE, Phase.PROBE, Phase.PROBE, Phase.TRAIN]
    assert [o.system for o in history[1:3]] == tuner.candidates()
    assert history[3].system == best == decisions[3].remember
    assert [(e.config, e.support) for e in gt.entries()] == [(best, 1)]

    history, decisions = trial(1, 3)
    assert [o.phase for o in history] == [Phase.PROFILE, Phase.TRAIN, Phase.TRAIN]
    assert [o.system for o in history[1:]] == [best] * 2
    assert "ground-truth hit" in decisions[1].reason
    assert len(gt) == 1
