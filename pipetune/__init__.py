"""pipetune: tune a deep-learning job's hyperparameters and system parameters together.

Importing this package is cheap: torch, scikit-learn, MLflow and Prefect are imported
only by the modules that need them (and Prefect never by the library).
"""

from pipetune._own_packages import install as _install_own_packages
from pipetune.errors import PipetuneError, SpecError, SystemConfigError, WorkloadError
from pipetune.system.config import MachineInfo, SystemConfig

__version__ = "0.1.0"

_install_own_packages()  # flows, tasks, deployments: ours, whatever the job's folder holds

__all__ = [
    "MachineInfo",
    "TuneResult",
    "PipetuneError",
    "SpecError",
    "SystemConfig",
    "SystemConfigError",
    "WorkloadError",
    "__version__",
    "tune",
]


def __getattr__(name: str):
    # The Python API (pipetune.api), imported on first use: ``import pipetune`` stays cheap.
    if name in ("tune", "TuneResult"):
        from pipetune import api

        return getattr(api, name)
    raise AttributeError(f"module 'pipetune' has no attribute {name!r}")
