"""A Dask worker's cores, read in one place.

An epoch claims its cores as a Dask resource (``resources={"cores": n}``), so the cores
a worker offers are the ``cores`` resource it advertises: ``dask worker --resources
cores=N``, or the machine's cores on the embedded cluster's workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def worker_cores(info: Mapping[str, Any], *, claimable: bool = False) -> float:
    """The cores a worker offers, from the scheduler's description of it
    (``client.scheduler_info(n_workers=-1)["workers"][address]``): its ``cores``
    resource. A worker advertising none counts its threads when a cluster's cores are
    counted, but offers no core an epoch can claim (``claimable=True``): Dask runs a
    task claiming ``cores`` only on a worker that advertises them.

    >>> worker_cores({"resources": {"cores": 4}, "nthreads": 1})
    4
    >>> worker_cores({"resources": {}, "nthreads": 2})
    2
    >>> worker_cores({"resources": {}, "nthreads": 2}, claimable=True)
    0
    """
    cores = (info.get("resources") or {}).get("cores")
    if cores is not None:
        return cores
    return 0 if claimable else info.get("nthreads", 1)
