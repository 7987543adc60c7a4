"""A workload for the orchestration tests, imported by path on Dask workers.

It is the real synthetic workload, except that a trial whose ``hidden`` size is 8
raises in epoch 2, as a user's broken model would.
"""

from __future__ import annotations

from pipetune.system.config import SystemConfig
from pipetune.workloads.synthetic import SyntheticWorkload


class FlakyWorkload(SyntheticWorkload):
    def _before_epoch(self, system: SystemConfig, steps: int) -> None:
        if self.hparams["hidden"] == 8 and self._epoch + 1 == 2:
            raise RuntimeError("flaky workload: hidden=8 breaks in epoch 2")
        super()._before_epoch(system, steps)
