"""Known answers shared by the tests: hand-made job profiles and a synthetic job whose
cheapest system config is known before any tuning runs."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from pathlib import Path

from pipetune.profiler.profile import PROFILE_FEATURES, Profile

#: A convolutional job's epoch-1 profile.
CONV_JOB = {
    "op_conv_share": 0.60,
    "op_matmul_share": 0.15,
    "op_elementwise_share": 0.15,
    "op_data_share": 0.05,
    "op_other_share": 0.05,
    "cpu_util": 0.90,
    "log_samples_per_s": 6.5,
    "log_flops_proxy": -6.0,
    "ctx_switches_per_step": 3.0,
    "page_faults_per_step": 40.0,
    "log_peak_rss_mb": 6.0,
}
#: A dense (MLP) job's epoch-1 profile: far from CONV_JOB in every clustered feature.
DENSE_JOB = {
    "op_conv_share": 0.0,
    "op_matmul_share": 0.70,
    "op_elementwise_share": 0.20,
    "op_data_share": 0.05,
    "op_other_share": 0.05,
    "cpu_util": 0.50,
    "log_samples_per_s": 9.5,
    "log_flops_proxy": -9.0,
    "ctx_switches_per_step": 1.0,
    "page_faults_per_step": 5.0,
    "log_peak_rss_mb": 5.0,
}


def noisy(job: dict[str, float], seed: int, scale: float = 1.0) -> Profile:
    """``job`` with run-to-run noise (``scale`` times the usual), well under the ground
    truth's noise floors at scale 1."""
    rng = random.Random(seed)
    out = {}
    for name in PROFILE_FEATURES:
        jitter = 0.01 if name.startswith("op_") else 0.03
        if name.endswith("_per_step"):
            jitter = 0.05 * job[name]
        out[name] = job[name] + scale * rng.uniform(-jitter, jitter)
    return Profile(out)


def synthetic_job(name: str, *, seed: int = 0, trials: int = 3) -> dict:
    """A tiny real study whose answer is known: the synthetic workload sleeps 0.3 s per
    epoch under interop_threads=1 and under dataloader_workers=1, so from the default
    (interop 1, workers 0) the cheapest one-knob probe is interop_threads=2."""
    return {
        "name": name,
        "workload": {
            "name": "synthetic",
            "params": {
                "train_samples": 256,
                "val_samples": 128,
                "cost_by_knob": {"interop_threads": {"1": 0.3},
                                 "dataloader_workers": {"1": 0.3}},
            },
        },
        "hyperparameters": {"lr": {"type": "loguniform", "low": 0.01, "high": 0.1}},
        "system": {
            "default": {"cores": 1, "interop_threads": 1, "dataloader_workers": 0},
            "space": {"interop_threads": [1, 2], "dataloader_workers": [0, 1]},
        },
        "search": {"algorithm": "random", "trials": trials, "seed": seed, "max_concurrent": 1},
        "early_stopping": {"policy": "none", "max_epochs": 3},
        "objective": {"metric": "accuracy", "mode": "max", "system": "time"},
    }


@contextlib.contextmanager
def process_cluster(n_workers: int = 2, cores: int = 2, **options) -> Iterator:
    """A real Dask ``LocalCluster`` of process workers, one thread each, advertising
    ``cores`` and able to import this folder's test workloads; non-daemonic workers so
    an epoch may start a data-loader process. ``options`` go to the ``LocalCluster``
    (``worker_port=...``: each worker, restarted too, on that port)."""
    import dask
    from distributed import LocalCluster

    tests_dir = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (tests_dir, os.environ.get("PYTHONPATH", "")) if p
    )
    # As the embedded cluster: the driver, not the scheduler, retries a lost epoch.
    with dask.config.set({"distributed.worker.daemon": False,
                          "distributed.scheduler.allowed-failures": 0}):
        cluster = LocalCluster(
            n_workers=n_workers, threads_per_worker=1, processes=True, host="127.0.0.1",
            dashboard_address=None, resources={"cores": cores}, **options,
        )
    try:
        yield cluster
    finally:
        cluster.close()


def wait_until_healthy(url: str, proc, log_path, timeout_s: float = 120.0) -> None:
    """Wait until the server at ``url`` answers ``/health`` with 200; fail with the tail
    of its log if its process ``proc`` exits first, or after ``timeout_s``."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert proc.poll() is None, Path(log_path).read_text()[-3000:]
        assert time.monotonic() < deadline, f"{url} did not come up in {timeout_s:.0f} s"
        time.sleep(0.5)


def tune_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a ``pipetune tune`` subprocess of a test: its own pipetune and
    Prefect homes under ``tmp_path``, this checkout and the tests' helpers importable,
    and no Prefect API (it starts its own server)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PIPETUNE_HOME": str(tmp_path / "home"),
           "PREFECT_HOME": str(tmp_path / "prefect"),
           "PYTHONPATH": os.pathsep.join(
               p for p in (str(root / "tests"), str(root), os.environ.get("PYTHONPATH", ""))
               if p)}
    env.pop("PREFECT_API_URL", None)
    return env


def user_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a user's own process: no Prefect API or MLflow store named, a
    pipetune home of its own under ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL",
                                                            "MLFLOW_TRACKING_URI")}
    env["PIPETUNE_HOME"] = str(tmp_path / "home")
    return env


def run_example(tmp_path: Path, example: Path, script: str, *args: str):
    """Copy ``example`` (a folder of ``examples/``) under ``tmp_path`` and run ``script``
    there as a user would; return its process, the MLflow client of the store it wrote
    (``./mlflow.db``), its one study run and that study's trial runs."""
    import shutil
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    folder = tmp_path / example.name
    shutil.copytree(example, folder, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, script, *args], cwd=folder, env=user_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    (parent,) = client.search_runs(
        [client.get_experiment_by_name("pipetune").experiment_id],
        "tags.`pipetune.kind` = 'study'")
    trials = client.search_runs([parent.info.experiment_id],
                                f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    return proc, client, parent, trials


def configs_run(client, trials, knobs: tuple[str, ...]) -> set[tuple[float, ...]]:
    """The system configs (``knobs``: ``sys_*`` metrics) the ``trials``' epochs ran
    under, as recorded in MLflow."""
    configs: set[tuple[float, ...]] = set()
    for run in trials:
        histories = [client.get_metric_history(run.info.run_id, k) for k in knobs]
        configs |= set(zip(*[[m.value for m in h] for h in histories], strict=True))
    return configs
