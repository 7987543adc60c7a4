"""Dask worker preload: warm a fresh worker process before it takes epochs.

A new worker pays one-time costs on its first epoch: importing torch and the
workloads, the first optimiser step (which loads torch's compiler
stack) and the first profiler trace. Paid inside epoch 1, they would be measured as
the default config's cost and inflate every profile taken on a fresh worker. The
embedded cluster lists this module in ``preload``; an existing cluster can use it with
``dask worker --preload pipetune.dask.worker_setup`` (``flows.worker_setup``, the name
older set-ups use, is the same).
"""

from __future__ import annotations


def warm_up() -> None:
    import torch

    import pipetune.dask.backend  # noqa: F401 - what every epoch task imports
    import pipetune.runner  # noqa: F401
    from pipetune.profiler.opmix import OpMixRecorder
    from pipetune.workloads import BUILTIN_WORKLOADS, resolve_workload

    for name in BUILTIN_WORKLOADS:
        resolve_workload(name)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = OpMixRecorder(1, 0, "cpu")
    recorder.start()
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.zeros(8, 4)).sum().backward()
        optimizer.step()
        recorder.step()
    recorder.finish()


class _NoHeartbeatTraceback:
    """A worker whose scheduler has just stopped (the study's driver is exiting) logs a
    failed heartbeat with the whole comm traceback; one line says it."""

    def filter(self, record) -> bool:
        if record.exc_info and "heartbeat" in str(record.msg):
            record.msg = f"{record.msg} ({record.exc_info[1]!r})"
            record.exc_info = None
            record.exc_text = None
        return True


def dask_setup(worker) -> None:  # the Dask preload hook
    import logging

    logging.getLogger("distributed.worker").addFilter(_NoHeartbeatTraceback())
    warm_up()
