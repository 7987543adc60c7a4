"""The embedded cluster's start: a worker dying while it starts costs one more try;
a cluster that cannot start gives one clear error, not a traceback from Dask."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

START = textwrap.dedent("""
    import pipetune.dask.cluster as cluster
    real = cluster.embedded_cluster_kwargs
    def flaky(workers=None):
        kwargs = real(workers)
        kwargs["preload"] = [*kwargs["preload"], "flaky_preload"]
        return kwargs
    cluster.embedded_cluster_kwargs = flaky
    try:
        c = cluster.shared_cluster(workers=1)
        print("started", len(c.scheduler_info["workers"]))
    except cluster.ClusterStartError as e:
        print("refused", e)
    finally:
        cluster.close_shared_cluster()
""")


def _start(tmp_path: Path, mark: str | None) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(root / "tests"), str(root), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("PIPETUNE_FLAKY_MARK", None)
    if mark:
        env["PIPETUNE_FLAKY_MARK"] = mark
    return subprocess.run([sys.executable, "-c", START], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def test_a_worker_dying_at_start_is_retried(tmp_path):
    done = _start(tmp_path, str(tmp_path / "failed-once"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "failed-once").exists()  # the first start did fail
    assert done.stdout.strip() == "started 1", done.stdout + done.stderr


def test_a_cluster_that_cannot_start_gives_one_clear_error(tmp_path):
    done = _start(tmp_path, None)
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert line.startswith("refused the embedded Dask cluster did not start (2 attempts; "
                           "last: "), line
    assert "--dask-address" in line


def test_the_cluster_and_its_client_keep_short_message_logs():
    """Dask keeps each stream's last 1,000 messages, a task's arguments in each sent
    task: over a 2,000-trial study on 16 slots that was most of the driver's growth
    (benchmarks/RESULTS.md). The embedded cluster and pipetune's clients keep 16."""
    from pipetune.dask import cluster

    def longest(dask_scheduler):
        streams = [*dask_scheduler.stream_comms.values(), *dask_scheduler.client_comms.values()]
        return max(len(s.recent_message_log) for s in streams)

    cluster.close_shared_cluster()
    try:
        cluster.shared_cluster(workers=1)
        client = cluster.client_for(None)
        for n in range(60):  # one message each way per task
            client.submit(bytes, n, pure=False).result()
        assert len(client.scheduler_comm.recent_message_log) <= 16
        assert client.run_on_scheduler(longest) <= 16
        worker = client.run(lambda dask_worker: len(dask_worker.batched_stream.recent_message_log))
        assert max(worker.values()) <= 16
    finally:
        cluster.close_shared_cluster()
