"""The embedded cluster's size: ``pipetune tune --workers N --cores-per-worker C``, kept
in the environment (``PIPETUNE_WORKERS``, ``PIPETUNE_CORES_PER_WORKER``) so a warm
service started by a sized command (:mod:`pipetune.service`, keyed by them) starts its
cluster the same size."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipetune.errors import PipetuneError


@dataclass(frozen=True)
class EmbeddedSize:
    """How the user sized the embedded cluster (``pipetune tune --workers N
    --cores-per-worker C``): N worker processes, each one slot (a place for one epoch)
    advertising C cores. Unsized (both None): one worker per core, each advertising
    the machine's cores."""

    workers: int | None = None
    cores_per_worker: int | None = None

    @property
    def sized(self) -> bool:
        return self.workers is not None or self.cores_per_worker is not None

    def resolve(self, machine_cores: int) -> tuple[int, int]:
        """``(workers, cores each advertises)`` on a machine of ``machine_cores``."""
        if not self.sized:
            return max(1, machine_cores), machine_cores
        cores = self.cores_per_worker or max(1, machine_cores // (self.workers or 1))
        return (self.workers or max(1, machine_cores // cores)), cores

    def core_budget(self, machine_cores: int) -> int | None:
        """The cores the engine may hand out at once: every slot's, when sized (a slot
        may claim more cores than the machine has: sleeping or waiting epochs use none);
        None (the machine's) otherwise."""
        if not self.sized:
            return None
        workers, cores = self.resolve(machine_cores)
        return workers * cores


#: Where the embedded cluster's size is kept (:func:`size_embedded_cluster` sets them),
#: so the warm service a sized command starts (:mod:`pipetune.service`, keyed by them)
#: starts its cluster the same size; a user may set them instead of the options.
SIZE_ENV = {"workers": "PIPETUNE_WORKERS", "cores_per_worker": "PIPETUNE_CORES_PER_WORKER"}


def size_embedded_cluster(workers: int | None, cores_per_worker: int | None) -> EmbeddedSize:
    """Size the embedded cluster this process (and a warm service it starts) starts;
    None keeps what the environment says. Refused (exit 2, naming the option) below 1
    or above :data:`MAX_EMBEDDED_WORKERS`. Call before the cluster starts."""
    for option, value in (("--workers", workers), ("--cores-per-worker", cores_per_worker)):
        if value is not None and not 1 <= value <= MAX_EMBEDDED_WORKERS:
            raise PipetuneError(f"{option}: must be between 1 and {MAX_EMBEDDED_WORKERS}, "
                                f"got {value}")
    for name, value in (("workers", workers), ("cores_per_worker", cores_per_worker)):
        if value is not None:
            os.environ[SIZE_ENV[name]] = str(value)
    return embedded_size()


def embedded_size() -> EmbeddedSize:
    """The embedded cluster's size, as :data:`SIZE_ENV` says (refused by name when it
    is not a whole number in range)."""
    values: dict[str, int | None] = {}
    for name, env in SIZE_ENV.items():
        raw = os.environ.get(env, "").strip()
        if not raw:
            values[name] = None
            continue
        try:
            values[name] = int(raw)
        except ValueError:
            values[name] = 0
        if not 1 <= values[name] <= MAX_EMBEDDED_WORKERS:
            raise PipetuneError(f"{env}: must be a whole number between 1 and "
                                f"{MAX_EMBEDDED_WORKERS}, got {raw!r}")
    return EmbeddedSize(**values)


#: The most worker processes (or cores a worker advertises) the embedded cluster takes.
MAX_EMBEDDED_WORKERS = 1024


