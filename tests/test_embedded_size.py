"""Many slots on the embedded cluster (``pipetune tune --workers N --cores-per-worker C``),
and the bookkeeping that must stay flat as a study grows: the ground truth read once
per change, a profile's children listed from /proc, a long trials table cut short."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from known import CONV_JOB, noisy, synthetic_job

from pipetune.cli.tune_display import SUMMARY_ROWS, summary_rows
from pipetune.dask.size import SIZE_ENV, EmbeddedSize, embedded_size, size_embedded_cluster
from pipetune.errors import PipetuneError

PIPETUNE = [sys.executable, "-m", "pipetune"]


def test_an_unsized_cluster_is_one_worker_per_core_each_offering_the_machine():
    assert EmbeddedSize().resolve(2) == (2, 2)
    assert EmbeddedSize().core_budget(2) is None  # the machine's cores


def test_a_sized_cluster_offers_every_slot_s_cores_even_past_the_machine_s():
    assert EmbeddedSize(16, 1).resolve(2) == (16, 1)
    assert EmbeddedSize(16, 1).core_budget(2) == 16
    assert EmbeddedSize(4, None).resolve(8) == (4, 2)  # the machine's cores shared out
    assert EmbeddedSize(None, 2).resolve(8) == (4, 2)


def test_the_size_is_kept_where_a_warm_service_started_now_inherits_it(monkeypatch):
    for env in SIZE_ENV.values():
        monkeypatch.delenv(env, raising=False)
    assert size_embedded_cluster(16, 1) == EmbeddedSize(16, 1)
    assert os.environ["PIPETUNE_WORKERS"] == "16"
    assert os.environ["PIPETUNE_CORES_PER_WORKER"] == "1"
    from pipetune.service import service_key

    sized = service_key()
    monkeypatch.setenv("PIPETUNE_WORKERS", "8")
    assert service_key() != sized  # another size, another warm service


@pytest.mark.parametrize("value", [0, 5000])
def test_a_size_out_of_range_is_refused_naming_the_option(value):
    with pytest.raises(PipetuneError, match=r"--workers: must be between 1 and 1024, got"):
        size_embedded_cluster(value, None)


def test_a_bad_size_in_the_environment_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv("PIPETUNE_CORES_PER_WORKER", "two")
    with pytest.raises(PipetuneError, match="PIPETUNE_CORES_PER_WORKER: must be a whole "
                                            "number between 1 and 1024, got 'two'"):
        embedded_size()


def _run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", *SIZE_ENV.values())}
    env.update(PIPETUNE_HOME=str(cwd / "home"), PIPETUNE_KEEP_WARM_S="0")
    return subprocess.run(PIPETUNE + args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize(("args", "field"), [
    (["--workers", "0"], "--workers: must be between 1 and 1024, got 0"),
    (["--cores-per-worker", "2", "--dask-address", "tcp://127.0.0.1:9"],
     "--cores-per-worker: sizes the embedded cluster: not with --dask-address"),
])
def test_a_bad_size_exits_2_in_one_line_and_records_nothing(tmp_path, args, field):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(synthetic_job("sized-bad")))
    proc = _run(["tune", str(path), *args], tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert field in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
def test_a_sized_cluster_runs_an_epoch_in_every_slot_at_once(tmp_path):
    """Four one-core slots on a machine of fewer cores: four sleeping epochs run at
    once, one per worker; the space is judged by one worker's cores."""
    job = synthetic_job("sized", trials=4)
    job["search"]["max_concurrent"] = 4
    job["early_stopping"]["max_epochs"] = 1
    job["workload"]["params"] = {"base_seconds": 2.0, "train_samples": 32, "val_samples": 16}
    job["system"] = {"default": {"cores": 1}, "space": {"cores": [1, 2]}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    proc = _run(["tune", str(path), "--workers", "4", "--cores-per-worker", "1"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "system.space.cores: 2 dropped: each embedded worker offers 1 core " \
           "(--cores-per-worker)" in proc.stdout + proc.stderr
    (events,) = (tmp_path / "home" / "studies").glob("sized-*/events.jsonl")
    results = [e["data"] for e in map(json.loads, events.read_text().splitlines())
               if e["kind"] == "result"]
    assert len(results) == 4
    assert len({r["address"] for r in results}) == 4
    assert max(r["started"] for r in results) < min(r["finished"] for r in results)


def _rows(n: int) -> list[dict]:
    rows = [{"trial": i, "outcome": "completed", "accuracy": i / n} for i in range(n)]
    rows[3] = {"trial": 3, "outcome": "failed", "accuracy": None}
    return rows


def test_a_long_trials_table_shows_the_best_and_the_failed_in_trial_order():
    shown = summary_rows(_rows(1000), "accuracy", "max")
    assert len(shown) == SUMMARY_ROWS
    assert [r["trial"] for r in shown] == [3, *range(1000 - SUMMARY_ROWS + 1, 1000)]
    lowest = summary_rows(_rows(1000), "accuracy", "min")
    assert [r["trial"] for r in lowest] == [*range(0, 3), *range(3, SUMMARY_ROWS)]
    assert summary_rows(_rows(SUMMARY_ROWS), "accuracy") == _rows(SUMMARY_ROWS)


def test_a_profile_counts_the_cpu_of_its_children_listed_from_proc():
    from pipetune.profiler.usage import _proc_children, snapshot, usage_between

    before = snapshot(frozenset())
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.4: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            live = _proc_children()
            if live and any(pid == child.pid and u.cpu_s >= 0.4
                            for (pid, _), u in live.items()):
                break
            time.sleep(0.05)
        after = snapshot(frozenset())
    finally:
        child.kill()
        child.wait()
    assert child.pid in {pid for pid, _ in after.live}
    assert usage_between(before, after).cpu_s >= 0.4


def test_the_ground_truth_reads_again_only_when_the_store_changed(tmp_path):
    from pipetune.groundtruth import GroundTruth
    from pipetune.system.config import SystemConfig

    path = tmp_path / "gt.json"
    reader, writer = GroundTruth(path), GroundTruth(path)
    assert reader.known("job-a", "time") is None
    first = reader._records()
    assert reader._records() is first  # unchanged: not parsed again
    writer.remember(noisy(CONV_JOB, 0), 32, "time", SystemConfig(cores=2), 0.01, job_key="job-a",
                    cost_unit="seconds")
    hit = reader.known("job-a", "time")  # another process's write is seen at once
    assert hit is not None and hit.config == SystemConfig(cores=2)
