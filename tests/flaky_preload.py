"""A Dask worker preload that fails the first worker start of a run (the marker file
under ``PIPETUNE_FLAKY_MARK`` remembers it), as a worker dying while the cluster
starts does; with ``PIPETUNE_FLAKY_MARK`` unset it fails every start."""

from __future__ import annotations

import os
from pathlib import Path


def dask_setup(worker) -> None:
    mark = os.environ.get("PIPETUNE_FLAKY_MARK")
    if mark and Path(mark).exists():
        return
    if mark:
        Path(mark).touch()
    os._exit(3)  # dies, as a worker killed while the cluster starts
