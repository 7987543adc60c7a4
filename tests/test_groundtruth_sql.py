"""The ground-truth stores' contract, run over each store: the JSON file, a SQLite file
and a real PostgreSQL server; then what only the SQL stores and locations do."""

from __future__ import annotations

import json
import math
import multiprocessing
import pickle
import sqlite3
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest
from known import CONV_JOB, DENSE_JOB, noisy
from pg_server import postgres_server  # noqa: F401  (a fixture)

from pipetune.errors import GroundTruthError
from pipetune.groundtruth import GROUNDTRUTH_ENV, GroundTruth, JsonStore
from pipetune.groundtruth.sql import SqlStore
from pipetune.groundtruth.sqlschema import RETRY_ENV
from pipetune.profiler.profile import CLUSTER_FEATURES
from pipetune.system.config import SystemConfig

CORES2 = SystemConfig(cores=2)
WORKERS1 = SystemConfig(dataloader_workers=1)
RECORDS = "pipetune_groundtruth_records"


@pytest.fixture(params=["json", "sqlite", "postgresql"])
def location(request, tmp_path) -> str:
    """A fresh, empty store of each kind (nothing created yet)."""
    if request.param == "json":
        return str(tmp_path / "gt.json")
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'gt.db'}"
    return request.getfixturevalue("postgres_server").create_database()


def _insert_behind_its_back(location: str, record) -> int:
    """Add ``record`` (an object, or raw text for a SQL row) without the store; returns
    the id the store should report it by."""
    if location.endswith(".json"):
        path = Path(location)
        data = json.loads(path.read_text())
        data["records"].append(record)
        path.write_text(json.dumps(data))
        return len(data["records"]) - 1
    text = record if isinstance(record, str) else json.dumps(record)
    now = datetime.now(UTC).isoformat()
    sql = f"INSERT INTO {RECORDS} (created_at, record) VALUES "
    if location.startswith("sqlite:///"):
        with sqlite3.connect(location.removeprefix("sqlite:///")) as conn:
            return conn.execute(sql + "(?, ?)", (now, text)).lastrowid
    import psycopg

    with psycopg.connect(location) as conn:
        return conn.execute(sql + "(%s, %s) RETURNING id", (now, text)).fetchone()[0]


def _valid_record(**changes) -> dict:
    rec = {"features": {n: CONV_JOB[n] for n in CLUSTER_FEATURES}, "batch_size": 32,
           "objective": "time", "config": CORES2.to_dict(), "cost": 0.01}
    return {**rec, **changes}


def _fill(gt: GroundTruth) -> None:
    for seed in range(3):
        gt.remember(noisy(CONV_JOB, seed), 32, "time", CORES2, 0.01 + seed, trial=f"c{seed}")
    gt.remember(noisy(DENSE_JOB, 0), 64, "energy", WORKERS1, 0.5, trial="d0")


def _records(gt: GroundTruth) -> list[dict]:
    return gt._store.read()


# -- the contract: every store ------------------------------------------------------------


def test_a_record_is_found_again_from_a_fresh_handle(location):
    gt = GroundTruth(location)
    assert len(gt) == 0 and not gt.lookup(noisy(CONV_JOB, 1), 32, "time").hit
    gt.remember(noisy(CONV_JOB, 1), 32, "time", CORES2, 0.01, job="cnn", trial="s/0")
    match = GroundTruth(location).lookup(noisy(CONV_JOB, 2), 40, "time")
    assert match.hit and match.config == CORES2 and match.cost == 0.01
    [stored] = _records(gt)
    assert stored["job"] == "cnn" and stored["trial"] == "s/0"
    assert pickle.loads(pickle.dumps(gt)).lookup(noisy(CONV_JOB, 2), 40, "time") == match


def _write_records(location: str, who: str, n: int, start) -> None:
    gt = GroundTruth(location)
    start.wait()
    for i in range(n):
        gt.remember(noisy(CONV_JOB, i), 32, "time", CORES2, 0.01 + i, job=who, trial=str(i))


def test_four_processes_writing_at_once_lose_and_duplicate_nothing(location):
    # The store is brand new: the writers also race to create it (its schema, for SQL).
    n, writers = 12, "abcd"
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=_write_records, args=(location, who, n, start))
             for who in writers]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(180)
    assert [p.exitcode for p in procs] == [0] * len(writers)
    records = _records(GroundTruth(location))
    assert len(records) == n * len(writers)
    seen = Counter((r["job"], r["trial"]) for r in records)
    assert seen == Counter((who, str(i)) for who in writers for i in range(n))


def test_audit_finds_a_bad_record_added_behind_the_stores_back(location):
    gt = GroundTruth(location)
    _fill(gt)
    bad = _insert_behind_its_back(location, _valid_record(cost=math.nan))
    unit = "record" if location.endswith(".json") else "row"
    found = gt.audit()
    assert not found.ok and found.records == 5
    assert found.problems == [f"{unit} {bad}: cost must be a finite number >= 0, got nan"]
    with pytest.raises(GroundTruthError, match=f"{unit} {bad}: cost") as info:
        gt.check()
    assert "pipetune groundtruth repair --path" in str(info.value)
    with pytest.raises(GroundTruthError):  # nor is anything written to a bad store
        gt.remember(noisy(CONV_JOB, 9), 32, "time", CORES2, 0.01)
    assert gt.audit().records == 5


def test_repair_keeps_the_valid_records_and_backs_up_the_rest(location, tmp_path, monkeypatch):
    monkeypatch.setenv("PIPETUNE_HOME", str(tmp_path / "home"))
    gt = GroundTruth(location)
    _fill(gt)
    good = _records(gt)
    _insert_behind_its_back(location, _valid_record(objective="speed"))
    if not location.endswith(".json"):  # a row that is not even JSON
        _insert_behind_its_back(location, "{not json")
    done = gt.repair()
    assert done.kept == 4 and len(done.found.bad) == done.found.records - 4 >= 1
    assert _records(gt) == good and gt.check() == 4
    backup = json.loads(Path(done.backup).read_text())
    assert len(backup["records"]) == done.found.records  # the whole store, as it was
    assert backup["records"][:4] == good
    if location.startswith("sqlite"):
        assert done.backup.parent == tmp_path
    elif location.startswith("postgresql"):
        assert done.backup.parent == tmp_path / "home"
    assert gt.repair().backup is None  # now valid: nothing to do
    assert gt.lookup(noisy(CONV_JOB, 7), 32, "time").hit


def test_clear_removes_every_record_and_says_how_many(location):
    gt = GroundTruth(location)
    assert gt.clear() == 0
    _fill(gt)
    assert gt.clear() == 4
    assert len(gt) == 0 and not gt.lookup(noisy(CONV_JOB, 1), 32, "time").hit
    assert len(GroundTruth(location)) == 0


def test_export_then_import_gives_the_same_records(location, tmp_path):
    gt = GroundTruth(location)
    _fill(gt)
    exported = tmp_path / "out" / "export.json"
    exported.parent.mkdir()
    assert gt.export_json(exported) == 4
    data = json.loads(exported.read_text())
    assert data["version"] == 1 and data["records"] == _records(gt)
    assert JsonStore(exported).read() == _records(gt)  # readable as a store, too

    gt.clear()
    assert gt.import_json(exported) == 4
    assert _records(gt) == data["records"]
    assert gt.lookup(noisy(DENSE_JOB, 3), 64, "energy").config == WORKERS1
    assert gt.import_json(exported) == 4 and len(gt) == 8  # import appends


def test_an_import_with_a_bad_record_is_refused_and_writes_nothing(location, tmp_path):
    gt = GroundTruth(location)
    _fill(gt)
    before, snapshot = _records(gt), gt._store.snapshot()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "records": [
        _valid_record(), _valid_record(batch_size=0), _valid_record()]}))
    with pytest.raises(GroundTruthError, match="record 1: batch_size"):
        gt.import_json(bad)
    with pytest.raises(GroundTruthError, match="no such file"):
        gt.import_json(tmp_path / "missing.json")
    assert _records(gt) == before and gt._store.snapshot() == snapshot


def test_the_snapshot_changes_on_a_write_and_not_on_a_read(location):
    gt = GroundTruth(location)
    gt.remember(noisy(CONV_JOB, 0), 32, "time", CORES2, 0.01)
    first = gt._store.snapshot()
    assert gt.lookup(noisy(CONV_JOB, 1), 32, "time").hit
    assert len(gt) == 1 and gt.check() == 1 and gt.audit().ok and gt.entries()
    assert gt.repair().backup is None
    assert GroundTruth(location)._store.snapshot() == first
    gt.remember(noisy(CONV_JOB, 2), 32, "time", CORES2, 0.01)
    second = gt._store.snapshot()
    assert second != first
    gt.clear()
    assert gt._store.snapshot() not in (first, second)


def test_a_capped_group_keeps_its_order_in_every_store(location):
    gt = GroundTruth(location, max_records_per_group=2)
    for i in range(4):
        gt.remember(noisy(CONV_JOB, i), 32, "time", CORES2, 1.0 + i, trial=f"c{i}")
    assert [r["trial"] for r in _records(gt)] == ["c2", "c3"]
    gt.remember(noisy(CONV_JOB, 9), 32, "time", WORKERS1, 0.5, trial="cheap")
    assert [r["trial"] for r in _records(gt)] == ["c3", "cheap"]


# -- locations ------------------------------------------------------------------------


def test_where_each_location_goes(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPETUNE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(GROUNDTRUTH_ENV, raising=False)
    default = GroundTruth()
    assert isinstance(default._store, SqlStore)
    assert default.path == tmp_path / "home" / "groundtruth.db"
    assert default.location == f"sqlite:///{tmp_path / 'home' / 'groundtruth.db'}"

    assert isinstance(GroundTruth(tmp_path / "a.json")._store, JsonStore)
    assert isinstance(GroundTruth(str(tmp_path / "A.JSON"))._store, JsonStore)
    other = GroundTruth(tmp_path / "gt.sqlite")
    assert isinstance(other._store, SqlStore) and other.path == tmp_path / "gt.sqlite"
    pg = GroundTruth("postgresql://u@db.example/gt")
    assert pg.path is None and pg._store.url.drivername == "postgresql+psycopg"
    assert GroundTruth("postgresql+psycopg://u@h/gt")._store.url.drivername == \
        "postgresql+psycopg"

    monkeypatch.setenv(GROUNDTRUTH_ENV, str(tmp_path / "env.json"))
    assert GroundTruth().path == tmp_path / "env.json"
    monkeypatch.setenv(GROUNDTRUTH_ENV, f"sqlite:///{tmp_path / 'env.db'}")
    assert GroundTruth().path == tmp_path / "env.db"
    assert not (tmp_path / "env.db").exists()  # nothing is opened before it is used


@pytest.mark.parametrize(("location", "why"), [
    ("mysql://u@h/db", "a ground-truth URL starts with postgresql://"),
    ("sqlite://", "needs a file"),
    ("", "a path or a URL"),
])
def test_locations_it_refuses(location, why):
    with pytest.raises(GroundTruthError, match=why):
        GroundTruth(location)


def test_a_password_is_never_shown(tmp_path, monkeypatch):
    monkeypatch.setenv(RETRY_ENV, "0")  # no waiting for the server to come back
    gt = GroundTruth("postgresql://user:s3cret@127.0.0.1:1/gt")  # nothing listens there
    assert gt.location == "postgresql+psycopg://user:***@127.0.0.1:1/gt"
    assert "s3cret" not in repr(gt)
    with pytest.raises(GroundTruthError) as info:
        len(gt)
    assert "s3cret" not in str(info.value) and "user:***@127.0.0.1:1/gt" in str(info.value)
    clone = pickle.loads(pickle.dumps(gt))  # ... yet a worker can still connect
    assert clone._store.url.password == "s3cret"


# -- the old default: imported once ---------------------------------------------------


def test_the_default_store_imports_the_old_json_once(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("PIPETUNE_HOME", str(home))
    monkeypatch.delenv(GROUNDTRUTH_ENV, raising=False)
    old = GroundTruth(home / "groundtruth.json")
    _fill(old)
    records = _records(old)

    gt = GroundTruth()
    assert _records(gt) == records and gt.lookup(noisy(CONV_JOB, 5), 32, "time").hit
    assert (home / "groundtruth.json").exists()  # left as it was
    gt.clear()
    assert len(GroundTruth()) == 0  # not imported a second time


def test_a_corrupt_old_json_stops_the_default_store_until_it_is_repaired(tmp_path,
                                                                         monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("PIPETUNE_HOME", str(home))
    monkeypatch.delenv(GROUNDTRUTH_ENV, raising=False)
    legacy = home / "groundtruth.json"
    legacy.write_text(json.dumps({"version": 1, "records": [
        _valid_record(), _valid_record(cost=-1)]}))
    with pytest.raises(GroundTruthError, match="pipetune groundtruth repair --path"):
        GroundTruth().check()
    assert GroundTruth(home / "groundtruth.db").check() == 0  # nothing was imported
    GroundTruth(legacy).repair()
    assert GroundTruth().check() == 1


def test_a_handle_that_wrote_sees_a_bad_row_added_behind_its_back_on_its_next_write(location):
    """Each store remembers the rows it read or wrote (a write reads the whole table); a
    row added since by another hand, or a write through another handle, is seen."""
    gt = GroundTruth(location)
    _fill(gt)  # this handle now holds the table as it wrote it
    GroundTruth(location).remember(noisy(CONV_JOB, 7), 32, "time", CORES2, 0.2, trial="o")
    assert len(_records(gt)) == 5  # another handle's write: read again
    _insert_behind_its_back(location, "{not json")
    with pytest.raises(GroundTruthError, match="not a valid ground.truth.*repair"):
        gt.remember(noisy(CONV_JOB, 8), 32, "time", CORES2, 0.3, trial="late")
    assert not gt.audit().ok


def test_leaders_walk_the_rows_in_order_nearest_first_of_equals():
    """The leader of each row, against the definition walked row by row."""
    import numpy as np

    from pipetune.groundtruth.model import leaders, noise_distance

    def walked(x, bound):
        found, out = [], []
        for i, row in enumerate(x):
            d = noise_distance(CLUSTER_FEATURES, x[found], row) if found else np.array([])
            if len(d) and d.min() <= bound:
                out.append(found[int(np.argmin(d))])
            else:
                found.append(i)
                out.append(i)
        return out

    rng = np.random.default_rng(0)
    k = len(CLUSTER_FEATURES)
    for _ in range(100):
        n, c = int(rng.integers(1, 40)), int(rng.integers(1, 5))
        centres = rng.normal(0, 5, (c, k)) * rng.choice([1, 100], (c, k))
        x = centres[rng.integers(0, c, n)] * (1 + rng.normal(0, 0.3, (n, k)))
        x = np.vstack([x, x[:3]])  # rows equal to earlier ones
        for bound in (0.5, 2.0):
            assert leaders(x, bound) == walked(x, bound)
