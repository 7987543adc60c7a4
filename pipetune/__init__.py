"""pipetune: tune a deep-learning job's hyperparameters and system parameters together.

Importing this package is cheap: torch, scikit-learn, MLflow and Prefect are imported
only by the modules that need them (and Prefect never by the library).
"""

from pipetune.errors import PipetuneError, SpecError, SystemConfigError, WorkloadError
from pipetune.system.config import MachineInfo, SystemConfig

__version__ = "0.1.0"

__all__ = [
    "MachineInfo",
    "PipetuneError",
    "SpecError",
    "SystemConfig",
    "SystemConfigError",
    "WorkloadError",
    "__version__",
]
