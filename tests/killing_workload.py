"""A workload for the fault-injection tests, imported by path on Dask workers.

The real synthetic workload, except that a trial whose ``hidden`` size is 8 SIGKILLs
its own worker process in epoch 2, every attempt (as an epoch that runs out of memory
does), and one whose ``hidden`` size is 16 does so once only, in its first attempt of
epoch 2 (a worker lost to the machine, not to the epoch): the marker file under
``PIPETUNE_KILL_MARKS`` remembers the attempt.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from pipetune.system.config import SystemConfig
from pipetune.workloads.synthetic import SyntheticWorkload


class KillingWorkload(SyntheticWorkload):
    def _before_epoch(self, system: SystemConfig, steps: int) -> None:
        if self._epoch + 1 == 2:
            hidden = self.hparams["hidden"]
            mark = Path(os.environ["PIPETUNE_KILL_MARKS"]) / f"hidden-{hidden}"
            if hidden == 8 or (hidden == 16 and not mark.exists()):
                mark.touch()
                os.kill(os.getpid(), signal.SIGKILL)
        super()._before_epoch(system, steps)


class HangingWorkload(SyntheticWorkload):
    """A trial whose ``hidden`` size is 8 hangs in epoch 2 (a data loader stuck on a
    dead file system), for an hour."""

    def _before_epoch(self, system: SystemConfig, steps: int) -> None:
        if self._epoch + 1 == 2 and self.hparams["hidden"] == 8:
            import time

            time.sleep(3600)
        super()._before_epoch(system, steps)


class FreezingWorkload(SyntheticWorkload):
    """A trial whose ``hidden`` size is 16 stops its own worker process with SIGSTOP in
    its first attempt of epoch 2 (a worker frozen mid-epoch: swapping, or stopped by
    someone), having written its pid and the time to ``frozen-16``; should the process
    be woken with SIGCONT, it writes ``woke-16`` and finishes the epoch as if nothing
    had happened (a late result, and a late checkpoint, for the driver to ignore)."""

    def _before_epoch(self, system: SystemConfig, steps: int) -> None:
        if self._epoch + 1 == 2 and self.hparams["hidden"] == 16:
            import time

            marks = Path(os.environ["PIPETUNE_KILL_MARKS"])
            mark = marks / "frozen-16"
            if not mark.exists():
                mark.write_text(f"{os.getpid()} {time.time()}")
                os.kill(os.getpid(), signal.SIGSTOP)
                (marks / "woke-16").write_text(str(time.time()))
        super()._before_epoch(system, steps)


class AlwaysFreezingWorkload(SyntheticWorkload):
    """A trial whose ``hidden`` size is 8 stops with SIGSTOP every worker process that
    runs its epoch 2 (an epoch that wedges whatever runs it), leaving ``frozen-8-<pid>``."""

    def _before_epoch(self, system: SystemConfig, steps: int) -> None:
        if self._epoch + 1 == 2 and self.hparams["hidden"] == 8:
            marks = Path(os.environ["PIPETUNE_KILL_MARKS"])
            (marks / f"frozen-8-{os.getpid()}").touch()
            os.kill(os.getpid(), signal.SIGSTOP)
        super()._before_epoch(system, steps)
