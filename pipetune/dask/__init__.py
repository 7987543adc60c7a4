"""Everything pipetune does with Dask, in one place; no Prefect.

- :mod:`~pipetune.dask.backend`: :class:`DaskBackend`, the driver placing every epoch;
- :mod:`~pipetune.dask.worker_side`: what runs on the workers (an epoch, an evaluation,
  a refusal, a release);
- :mod:`~pipetune.dask.cluster`: the embedded ``LocalCluster`` and what a study asks of
  a cluster before its first epoch;
- :mod:`~pipetune.dask.worker_setup`: the workers' preload (``--preload
  pipetune.dask.worker_setup``);
- :mod:`~pipetune.dask.ship`: a job's own workload module put on the workers;
- :mod:`~pipetune.dask.cores`: a worker's cores, read in one place;
- :mod:`~pipetune.dask.address`: which scheduler addresses pipetune connects to, and
  with what TLS.

Importing this package imports nothing of Dask: each module does, when imported.
"""
