"""A workload for the failure tests, imported by path on Dask workers.

The real synthetic workload, except that in the first epoch of a trial whose ``hidden``
is above ``corrupt_hidden_above`` it overwrites the ground-truth file named by
``corrupt_path`` with garbage, so the study fails at the lookup that follows, half-way
through: what was recorded before must survive. (``hidden`` shapes the model, so such
a trial is another job than the ones before it and looks its profile up.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pipetune.system.config import SystemConfig
from pipetune.workloads.synthetic import SyntheticWorkload


class CorruptingWorkload(SyntheticWorkload):
    param_defaults: ClassVar[dict[str, Any]] = {
        **SyntheticWorkload.param_defaults, "corrupt_path": "", "corrupt_hidden_above": 1_000_000}

    def _before_epoch(self, system: SystemConfig, steps: int) -> None:
        path, above = self.settings["corrupt_path"], int(self.settings["corrupt_hidden_above"])
        if path and self.hparams["hidden"] > above:
            Path(path).write_text("{not json")
        super()._before_epoch(system, steps)
