"""The ground truth store: clustering answers, persistence, concurrent writers."""

from __future__ import annotations

import json
import math
import os
import pickle
import stat

import pytest
from known import CONV_JOB, DENSE_JOB, noisy

from pipetune.errors import GroundTruthError, SpecError
from pipetune.groundtruth import GroundTruth, GroundTruthEntry
from pipetune.profiler.profile import CLUSTER_FEATURES, PROFILE_FEATURES, Profile
from pipetune.system.config import SystemConfig

CORES2 = SystemConfig(cores=2)
WORKERS1 = SystemConfig(dataloader_workers=1)


@pytest.fixture
def gt(tmp_path) -> GroundTruth:
    return GroundTruth(tmp_path / "gt.json")


def test_empty_store_misses(gt):
    match = gt.lookup(noisy(CONV_JOB, 0), 32, "time")
    assert not match.hit and match.config is None and match.bucket == 32
    assert "no records" in match.reason
    assert len(gt) == 0 and gt.entries() == [] and gt.clusters() == []
    assert not gt.path.exists()  # reading creates nothing


def test_similar_profile_hits_and_survives_a_reload(gt):
    gt.remember(noisy(CONV_JOB, 1), 32, "time", CORES2, 0.01, job="cnn", trial="s/0")
    match = gt.lookup(noisy(CONV_JOB, 2), 40, "time")  # 40 shares bucket 32
    assert match.hit and match.config == CORES2 and match.cost == 0.01
    assert match.cluster == 0 and match.bucket == 32 and match.support == 1
    assert match.distance <= match.bound == gt.min_bound  # a one-record cluster's reach

    reloaded = GroundTruth(gt.path)
    assert len(reloaded) == 1
    assert reloaded.lookup(noisy(CONV_JOB, 2), 40, "time") == match
    stored = json.loads(gt.path.read_text())["records"][0]
    assert stored["job"] == "cnn" and stored["trial"] == "s/0" and stored["batch_size"] == 32
    assert set(stored["features"]) == set(CLUSTER_FEATURES)


def test_dissimilar_profile_misses_with_its_distance(gt):
    gt.remember(noisy(CONV_JOB, 1), 32, "time", CORES2, 0.01)
    match = gt.lookup(noisy(DENSE_JOB, 2), 32, "time")
    assert not match.hit and match.cluster == 0 and match.distance > match.bound
    assert match.reason.startswith("new job")


def test_a_hit_needs_the_bucket_and_objective_too(gt):
    gt.remember(noisy(CONV_JOB, 1), 32, "time", CORES2, 0.01)
    other_bucket = gt.lookup(noisy(CONV_JOB, 2), 128, "time")
    assert not other_bucket.hit and other_bucket.cluster == 0
    assert other_bucket.distance <= other_bucket.bound
    assert "batch bucket 128" in other_bucket.reason
    assert not gt.lookup(noisy(CONV_JOB, 2), 32, "energy").hit


def test_two_jobs_make_two_clusters_numbered_by_their_oldest_record(gt):
    for seed in range(3):
        gt.remember(noisy(DENSE_JOB, seed), 64, "time", WORKERS1, 0.002)
    for seed in range(3, 5):
        gt.remember(noisy(CONV_JOB, seed), 32, "time", CORES2, 0.01)

    clusters = gt.clusters()
    assert [(c["id"], c["size"]) for c in clusters] == [(0, 3), (1, 2)]
    assert clusters[0]["centroid"]["op_matmul_share"] == pytest.approx(0.70, abs=0.02)
    assert clusters[1]["centroid"]["op_conv_share"] == pytest.approx(0.60, abs=0.02)
    assert [e["config"] for e in clusters[1]["entries"]] == [CORES2.to_dict()]
    assert gt.entries() == [
        GroundTruthEntry(0, 64, "time", WORKERS1, 0.002, 3),
        GroundTruthEntry(1, 32, "time", CORES2, 0.01, 2),
    ]
    assert gt.lookup(noisy(CONV_JOB, 9), 32, "time").config == CORES2
    assert gt.lookup(noisy(DENSE_JOB, 9), 64, "time").config == WORKERS1


def test_a_job_between_two_known_jobs_is_similar_to_neither(gt):
    # The store's spread grows with every different job; similarity must not loosen.
    for seed in range(3):
        gt.remember(noisy(DENSE_JOB, seed), 32, "time", WORKERS1, 0.002)
        gt.remember(noisy(CONV_JOB, seed + 10), 32, "time", CORES2, 0.01)
    # Halfway. (Measured on real workloads with 10 sampled steps: the same job under
    # another learning rate lies <= 1.5 noise units away, LeNet-5 vs the text CNN >= 3.2;
    # min_bound 2 sits between, so a job 30% of the way from a known one may match it.)
    between = Profile({k: 0.5 * CONV_JOB[k] + 0.5 * DENSE_JOB[k] for k in PROFILE_FEATURES})
    match = gt.lookup(between, 32, "time")
    assert not match.hit and match.reason.startswith("new job")
    assert gt.lookup(noisy(CONV_JOB, 50), 32, "time").hit


def test_max_clusters_caps_the_clustering(tmp_path):
    one = GroundTruth(tmp_path / "gt.json", max_clusters=1)
    one.remember(noisy(DENSE_JOB, 0), 64, "time", WORKERS1, 0.002)
    one.remember(noisy(CONV_JOB, 1), 32, "time", CORES2, 0.01)
    [cluster] = one.clusters()
    assert cluster["size"] == 2
    # The bound grows with the spread, so both jobs are still found in it.
    assert cluster["bound"] == pytest.approx(2.0 * cluster["radius"]) and cluster["bound"] > 1.0
    assert one.lookup(noisy(CONV_JOB, 2), 32, "time").config == CORES2


def test_best_config_is_the_lowest_median_and_support_counts_its_records(gt):
    costs = [(CORES2, 1.0), (CORES2, 1.1), (CORES2, 9.0), (WORKERS1, 1.05)]
    for seed, (config, cost) in enumerate(costs):
        gt.remember(noisy(CONV_JOB, seed), 32, "time", config, cost)
    match = gt.lookup(noisy(CONV_JOB, 99), 32, "time")
    assert match.config == WORKERS1 and match.cost == 1.05 and match.support == 1
    # The median shrugs off cores=2's one bad trial (9.0), but 1.1 still loses to 1.05.
    # Two more cheap cores=2 trials bring its median to 1.0.
    gt.remember(noisy(CONV_JOB, 7), 32, "time", CORES2, 0.5)
    gt.remember(noisy(CONV_JOB, 8), 32, "time", CORES2, 0.5)
    match = gt.lookup(noisy(CONV_JOB, 99), 32, "time")
    assert match.config == CORES2 and match.cost == 1.0 and match.support == 5


def test_equal_medians_go_to_the_config_more_trials_chose(gt):
    for seed, config in enumerate([WORKERS1, CORES2, CORES2]):
        gt.remember(noisy(CONV_JOB, seed), 32, "time", config, 1.0)
    assert gt.lookup(noisy(CONV_JOB, 9), 32, "time").config == CORES2


def test_a_new_record_from_elsewhere_is_seen_at_the_next_lookup(gt):
    assert not gt.lookup(noisy(CONV_JOB, 1), 32, "time").hit
    GroundTruth(gt.path).remember(noisy(CONV_JOB, 2), 32, "time", CORES2, 0.01)
    assert gt.lookup(noisy(CONV_JOB, 1), 32, "time").hit


# Writers in several processes at once: the store contract test
# (test_groundtruth_sql.py::test_four_processes_writing_at_once_lose_and_duplicate_nothing)
# runs it over the JSON file too, with four writers.


def test_corrupt_file_is_reported_by_path_and_left_alone(gt):
    gt.path.write_text('{"records": [ {"features": ')
    with pytest.raises(GroundTruthError, match=str(gt.path)):
        gt.lookup(noisy(CONV_JOB, 1), 32, "time")
    with pytest.raises(GroundTruthError, match=str(gt.path)):
        gt.remember(noisy(CONV_JOB, 1), 32, "time", CORES2, 0.01)
    assert gt.path.read_text() == '{"records": [ {"features": '
    gt.path.write_text(json.dumps({"records": [{**_valid_record(), "batch_size": 0}]}))
    with pytest.raises(GroundTruthError, match="record 0: batch_size must be an integer"):
        len(gt)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o600])
def test_a_rewrite_keeps_the_files_permissions(gt, mode):
    gt.remember(noisy(CONV_JOB, 0), 32, "time", CORES2, 0.01)
    os.chmod(gt.path, mode)
    gt.remember(noisy(CONV_JOB, 1), 32, "time", CORES2, 0.02)
    assert stat.S_IMODE(gt.path.stat().st_mode) == mode
    assert len(gt) == 2


def test_a_new_store_gets_the_umask_permissions_not_0600(gt):
    old = os.umask(0o022)
    try:
        gt.remember(noisy(CONV_JOB, 0), 32, "time", CORES2, 0.01)
    finally:
        os.umask(old)
    assert stat.S_IMODE(gt.path.stat().st_mode) == 0o644


def test_check_reads_the_whole_store_or_says_what_is_wrong(gt):
    assert gt.check() == 0
    gt.remember(noisy(CONV_JOB, 0), 32, "time", CORES2, 0.01)
    assert gt.check() == 1
    text = gt.path.read_text()
    gt.path.write_text(text.replace('"cost": 0.01', '"cost": NaN'))
    with pytest.raises(GroundTruthError, match=f"{gt.path}.*cost"):
        gt.check()


def test_clear_removes_every_record_and_says_how_many(gt):
    assert gt.clear() == 0
    for seed in range(3):
        gt.remember(noisy(CONV_JOB, seed), 32, "time", CORES2, 0.01)
    assert gt.clear() == 3
    assert len(gt) == 0 and not gt.lookup(noisy(CONV_JOB, 1), 32, "time").hit


def test_profiles_and_values_it_cannot_use(gt):
    partial = Profile({"op_conv_share": 0.5})
    with pytest.raises(GroundTruthError, match="lacks features"):
        gt.lookup(partial, 32, "time")
    nan_profile = Profile({**CONV_JOB, "log_flops_proxy": math.nan})
    assert not gt.lookup(nan_profile, 32, "time").hit
    with pytest.raises(GroundTruthError, match="log_flops_proxy is not a finite number"):
        gt.remember(nan_profile, 32, "time", CORES2, 0.01)
    with pytest.raises(GroundTruthError, match="objective"):
        gt.lookup(noisy(CONV_JOB, 1), 32, "speed")
    with pytest.raises(GroundTruthError, match="cost"):
        gt.remember(noisy(CONV_JOB, 1), 32, "time", CORES2, math.inf)
    with pytest.raises(GroundTruthError, match="batch size"):
        gt.remember(noisy(CONV_JOB, 1), 0, "time", CORES2, 0.01)
    assert len(gt) == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_clusters": 0}, "pipetune.similarity.max_clusters"),
        ({"bound_factor": -1.0}, "pipetune.similarity.bound_factor"),
        ({"min_bound": 0.0}, "pipetune.similarity.min_bound"),
        ({"max_records_per_group": 0}, "max_records_per_group"),
    ],
)
def test_bad_settings_name_the_field(tmp_path, kwargs, field):
    with pytest.raises(SpecError) as info:
        GroundTruth(tmp_path / "gt.json", **kwargs)
    assert info.value.field == field


def test_buckets_are_powers_of_two():
    assert [GroundTruth.bucket(b) for b in (1, 2, 3, 16, 31, 32, 100, 256)] == [
        1,
        2,
        2,
        16,
        16,
        32,
        64,
        256,
    ]


def test_default_path_is_in_the_pipetune_home(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPETUNE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PIPETUNE_GROUNDTRUTH", raising=False)
    store = GroundTruth()  # a SQLite file since the ground truth moved to SQL
    assert store.path == tmp_path / "home" / "groundtruth.db"
    assert (tmp_path / "home").is_dir()


def test_store_crosses_a_process_boundary(gt):
    gt.remember(noisy(CONV_JOB, 1), 32, "time", CORES2, 0.01)
    before = gt.lookup(noisy(CONV_JOB, 2), 32, "time")
    clone = pickle.loads(pickle.dumps(gt))
    assert clone.lookup(noisy(CONV_JOB, 2), 32, "time") == before


def test_a_busier_machine_or_a_fresh_process_does_not_hide_a_known_job(gt):
    """Wall-clock speed, utilisation and per-step counts move with machine load and
    process warmth; the same job measured under them must still match."""
    gt.remember(noisy(CONV_JOB, 0), 32, "time", CORES2, 0.01)
    busy = {
        **CONV_JOB,
        "log_samples_per_s": CONV_JOB["log_samples_per_s"] - 0.7,  # half the speed
        "cpu_util": CONV_JOB["cpu_util"] / 2,
        "page_faults_per_step": 0.0,
        "ctx_switches_per_step": 30.0,
    }
    assert gt.lookup(noisy(busy, 1), 32, "time").hit


def _valid_record(**changes) -> dict:
    rec = {"features": {n: CONV_JOB[n] for n in CLUSTER_FEATURES}, "batch_size": 32,
           "objective": "time", "config": CORES2.to_dict(), "cost": 0.01}
    return {**rec, **changes}


def _write_store(path, records) -> None:
    path.write_text(json.dumps({"version": 1, "records": records}))


def _records(gt) -> list[dict]:
    return json.loads(gt.path.read_text())["records"]


# -- validated on write ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "cost", "why"),
    [
        ({**CONV_JOB, "op_conv_share": math.nan}, 0.01, "op_conv_share is not a finite number"),
        ({**CONV_JOB, "log_peak_rss_mb": -math.inf}, 0.01, "log_peak_rss_mb is not a finite"),
        (CONV_JOB, math.nan, "cost must be a finite number >= 0, got nan"),
        (CONV_JOB, math.inf, "cost must be a finite number >= 0, got inf"),
        (CONV_JOB, -1.0, "cost must be a finite number >= 0, got -1.0"),
        ({k: v for k, v in CONV_JOB.items() if k != "op_data_share"}, 0.01, "lacks features"),
    ],
)
def test_a_record_that_would_not_read_back_is_refused_and_nothing_written(
    gt, profile, cost, why
):
    gt.remember(noisy(CONV_JOB, 0), 32, "time", CORES2, 0.01)
    before = gt.path.read_bytes()
    with pytest.raises(GroundTruthError, match=why):
        gt.remember(Profile(profile), 32, "time", CORES2, cost)
    assert gt.path.read_bytes() == before and gt.check() == 1


@pytest.mark.parametrize(
    ("features", "named"),
    [
        ({n: CONV_JOB[n] for n in CLUSTER_FEATURES if n != "op_data_share"},
         "missing ['op_data_share']"),
        ({**{n: CONV_JOB[n] for n in CLUSTER_FEATURES}, "gpu_util": 0.5}, "extra ['gpu_util']"),
    ],
)
def test_a_store_of_another_dimension_refuses_new_records(gt, features, named):
    _write_store(gt.path, [_valid_record(features=features)])
    before = gt.path.read_bytes()
    with pytest.raises(GroundTruthError, match=r"record 0: features differ") as info:
        gt.remember(noisy(CONV_JOB, 0), 32, "time", CORES2, 0.01)
    assert named in str(info.value)
    assert gt.path.read_bytes() == before
    with pytest.raises(GroundTruthError, match="features differ"):
        gt.lookup(noisy(CONV_JOB, 0), 32, "time")


def test_a_corrupt_store_names_the_first_problem_and_the_repair_command(gt):
    _write_store(gt.path, [_valid_record(), _valid_record(cost=math.nan), "junk"])
    with pytest.raises(GroundTruthError) as info:
        gt.check()
    message = str(info.value)
    assert message.startswith(f"{gt.path}: not a valid ground-truth file (record 1: cost")
    assert "and 1 more bad record(s)" in message
    assert f"`pipetune groundtruth repair --path {gt.path}`" in message


# -- audit and repair -----------------------------------------------------------------


def test_audit_lists_every_bad_record_with_its_index_and_why(gt):
    assert gt.audit().ok and gt.audit().records == 0 and not gt.path.exists()
    _write_store(gt.path, [
        _valid_record(),
        _valid_record(cost=math.nan),
        _valid_record(),
        {"features": {}},
        _valid_record(objective="speed"),
        _valid_record(features={**_valid_record()["features"], "op_conv_share": 10**400}),
    ])
    found = gt.audit()
    assert not found.ok and found.records == 6 and found.unreadable is None
    assert [i for i, _ in found.bad] == [1, 3, 4, 5]
    assert found.problems == [
        "record 1: cost must be a finite number >= 0, got nan",
        "record 3: lacks batch_size, objective, config, cost",
        "record 4: objective must be one of ('time', 'energy'), got 'speed'",
        f"record 5: feature op_conv_share is not a finite number ({10**400!r})",
    ]


def test_audit_of_a_file_that_is_not_a_ground_truth(gt):
    gt.path.write_text('{"records": [')
    found = gt.audit()
    assert not found.ok and found.records == 0 and found.unreadable
    assert found.problems == [f"not a ground-truth file: {found.unreadable}"]
    gt.path.write_text(json.dumps({"records": {}}))
    assert "'records' list" in gt.audit().unreadable


@pytest.mark.parametrize("mode", [0o640, 0o600])
def test_repair_backs_up_then_keeps_the_valid_records_and_the_mode(gt, mode):
    gt.remember(noisy(CONV_JOB, 0), 32, "time", CORES2, 0.01)
    gt.remember(noisy(CONV_JOB, 1), 32, "time", CORES2, 0.02)
    good = _records(gt)
    _write_store(gt.path, [good[0], {**good[1], "cost": -1}, good[1], "junk"])
    os.chmod(gt.path, mode)
    before = gt.path.read_bytes()

    done = gt.repair()
    assert done.kept == 2 and [i for i, _ in done.found.bad] == [1, 3] and done.moved is None
    assert done.backup == gt.backup_path and gt.backup_path.read_bytes() == before
    assert _records(gt) == good
    assert stat.S_IMODE(gt.path.stat().st_mode) == mode
    assert stat.S_IMODE(gt.backup_path.stat().st_mode) == mode
    assert gt.check() == 2 and gt.lookup(noisy(CONV_JOB, 2), 32, "time").hit


def test_repair_moves_an_unparseable_file_aside_and_starts_an_empty_store(gt):
    text = '{"records": [ {"features": '
    gt.path.write_text(text)
    os.chmod(gt.path, 0o640)
    done = gt.repair()
    assert done.kept == 0 and done.found.unreadable
    assert done.moved.parent == gt.path.parent
    assert done.moved.name.startswith("gt.json.corrupt-") and done.moved.read_text() == text
    assert gt.backup_path.read_text() == text
    assert stat.S_IMODE(gt.path.stat().st_mode) == 0o640
    assert gt.check() == 0
    gt.remember(noisy(CONV_JOB, 0), 32, "time", CORES2, 0.01)
    assert len(gt) == 1
    # Corrupt again in the same second: the first set-aside copy is not overwritten.
    gt.path.write_text("{")
    again = gt.repair()
    assert again.moved != done.moved and done.moved.read_text() == text


def test_repair_leaves_a_valid_store_alone(gt):
    assert gt.repair().backup is None and not gt.path.exists()
    gt.remember(noisy(CONV_JOB, 0), 32, "time", CORES2, 0.01)
    before = gt.path.read_bytes()
    done = gt.repair()
    assert done.found.ok and done.kept == 1 and done.backup is None and done.moved is None
    assert gt.path.read_bytes() == before and not gt.backup_path.exists()


def test_repair_refuses_a_store_from_a_newer_pipetune(gt):
    text = json.dumps({"version": 99, "records": ["whatever it means there"]})
    gt.path.write_text(text)
    with pytest.raises(GroundTruthError, match="newer pipetune"):
        gt.repair()
    assert gt.path.read_text() == text and not gt.backup_path.exists()


# -- one fit per version of the store -------------------------------------------------


class CountingGroundTruth(GroundTruth):
    """Counts its k-means fits."""

    fits = 0

    def _fit_records(self, records, key):
        self.fits += 1
        return super()._fit_records(records, key)


def test_lookups_refit_only_when_the_stores_content_changed(gt):
    writer = GroundTruth(gt.path)
    for seed in range(3):
        writer.remember(noisy(CONV_JOB, seed), 32, "time", CORES2, 0.01)
    reader = CountingGroundTruth(gt.path)
    for seed in range(5):
        assert reader.lookup(noisy(CONV_JOB, 10 + seed), 32, "time").hit
    assert reader.entries() and reader.clusters()
    assert reader.fits == 1

    gt.path.write_bytes(gt.path.read_bytes())  # rewritten and touched, same content
    later = gt.path.stat().st_mtime_ns + 10**9
    os.utime(gt.path, ns=(later, later))
    assert reader.lookup(noisy(CONV_JOB, 20), 32, "time").hit
    assert reader.fits == 1

    writer.remember(noisy(DENSE_JOB, 0), 64, "time", WORKERS1, 0.002)  # from elsewhere
    assert reader.lookup(noisy(DENSE_JOB, 1), 64, "time").hit
    assert reader.lookup(noisy(CONV_JOB, 21), 32, "time").hit
    assert reader.fits == 2

    # Its own record is fitted once, by the background fit or by the lookup, not both.
    reader.remember(noisy(CONV_JOB, 22), 32, "energy", CORES2, 1.0)
    assert reader.lookup(noisy(CONV_JOB, 23), 32, "energy").hit
    assert reader.lookup(noisy(CONV_JOB, 24), 32, "energy").hit
    assert reader.fits == 3


# -- bounded growth -------------------------------------------------------------------


def test_a_group_is_capped_and_its_best_record_survives(tmp_path):
    gt = GroundTruth(tmp_path / "gt.json", max_records_per_group=3)
    gt.remember(noisy(CONV_JOB, 0), 32, "time", CORES2, 0.5, trial="best")
    # Other groups: another job, another bucket, another objective.
    gt.remember(noisy(DENSE_JOB, 0), 32, "time", WORKERS1, 0.1, trial="dense")
    gt.remember(noisy(CONV_JOB, 1), 64, "time", WORKERS1, 0.1, trial="bucket64")
    gt.remember(noisy(CONV_JOB, 2), 32, "energy", WORKERS1, 0.1, trial="energy")
    for i in range(6):
        gt.remember(noisy(CONV_JOB, 10 + i), 32, "time", WORKERS1, 1.0 + i, trial=f"w{i}")
        in_group = [r for r in _records(gt) if r["trial"] == "best" or r["trial"][0] == "w"]
        assert len(in_group) == min(3, 2 + i)
    assert [r["trial"] for r in _records(gt)] == [
        "best", "dense", "bucket64", "energy", "w4", "w5"
    ]
    match = gt.lookup(noisy(CONV_JOB, 99), 32, "time")
    assert match.config == CORES2 and match.cost == 0.5


def test_the_oldest_records_go_first_and_a_cheaper_newcomer_stays(tmp_path):
    gt = GroundTruth(tmp_path / "gt.json", max_records_per_group=2)
    for i in range(4):  # every record chose the best config: the oldest go
        gt.remember(noisy(CONV_JOB, i), 32, "time", CORES2, 1.0 + i, trial=f"c{i}")
    assert [r["trial"] for r in _records(gt)] == ["c2", "c3"]
    gt.remember(noisy(CONV_JOB, 9), 32, "time", WORKERS1, 0.5, trial="cheap")
    assert [r["trial"] for r in _records(gt)] == ["c3", "cheap"]
    assert gt.lookup(noisy(CONV_JOB, 99), 32, "time").config == WORKERS1


def test_record_is_the_deprecated_name_of_remember(tmp_path):
    """``GroundTruth.record`` still stores, with a DeprecationWarning naming ``remember``."""
    gt = GroundTruth(tmp_path / "gt.json")
    with pytest.warns(DeprecationWarning, match="GroundTruth.remember"):
        gt.record(noisy(CONV_JOB, 1), 32, "time", CORES2, 0.01)
    assert GroundTruth(tmp_path / "gt.json").lookup(noisy(CONV_JOB, 1), 32, "time").hit
