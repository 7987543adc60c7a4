"""The workers' preload under its old name: ``dask worker --preload flows.worker_setup``
is :mod:`pipetune.dask.worker_setup`."""

from pipetune.dask.worker_setup import dask_setup, warm_up  # noqa: F401
