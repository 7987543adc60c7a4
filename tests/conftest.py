"""Test environment: every test run gets its own Prefect home, pipetune home and
MLflow store, and nothing phones home. Set before Prefect or MLflow is imported."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

_RUN_DIR = Path(tempfile.mkdtemp(prefix="pipetune-tests-"))
os.environ["PREFECT_HOME"] = str(_RUN_DIR / "prefect")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "120"
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
os.environ["PIPETUNE_HOME"] = str(_RUN_DIR / "pipetune-home")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
os.environ.pop("PREFECT_API_URL", None)
os.environ.pop("MLFLOW_TRACKING_URI", None)
# Each test's `pipetune tune` starts and stops its own server and cluster, as before the
# warm service (pipetune.service); tests/test_warm_service.py covers the warm default.
os.environ["PIPETUNE_KEEP_WARM_S"] = "0"
# A developer's team-stack settings (`eval "$(pipetune stack env)"`) stay out of tests.
for _name in ("PIPETUNE_GROUNDTRUTH", "PIPETUNE_CHECKPOINTS", "PIPETUNE_DASK_ADDRESS",
              "PIPETUNE_DASK_ALLOW_INSECURE", "PIPETUNE_DASK_TLS_CA_FILE",
              "PIPETUNE_DASK_TLS_CERT", "PIPETUNE_DASK_TLS_KEY"):
    os.environ.pop(_name, None)

#: The real datasets beside the project (absent on a user's machine).
SHARED_DATASETS = Path(
    os.environ.get("PIPETUNE_DATASETS", Path(__file__).resolve().parents[2] / "shared" / "datasets")
)


@pytest.fixture(autouse=True)
def embedded_cluster_settings_stay_in_their_test():
    """Starting the embedded cluster sets two process-wide things (pipetune.dask.cluster):
    OMP_WAIT_POLICY in the environment and Dask's worker start method (a fork server,
    whose workers keep the environment it started with). A later test's own cluster
    must start its workers as Dask's default does, with that test's environment."""
    omp = os.environ.get("OMP_WAIT_POLICY")
    yield
    if omp is None:
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ["OMP_WAIT_POLICY"] = omp
    if "dask" in sys.modules:
        import dask

        dask.config.set({"distributed.worker.multiprocessing-method": "spawn"})


@pytest.fixture(scope="session")
def shared_datasets() -> Path:
    if not SHARED_DATASETS.is_dir():
        pytest.skip(f"real datasets not present at {SHARED_DATASETS}")
    return SHARED_DATASETS


@pytest.fixture(scope="session")
def prefect_api_url():
    """A real Prefect server on a free loopback port for the whole session."""
    from pipetune.prefect_server import LocalPrefectServer

    server = LocalPrefectServer(log_path=_RUN_DIR / "prefect-server.log").start()
    os.environ["PREFECT_API_URL"] = server.api_url
    _refresh_prefect_settings()
    try:
        yield server.api_url
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        _refresh_prefect_settings()
        server.stop()


def _refresh_prefect_settings() -> None:
    """Prefect reads its settings once, at import: a test that imported it before this
    fixture set PREFECT_API_URL would otherwise keep talking to a throwaway server."""
    if "prefect.context" in sys.modules:
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()
