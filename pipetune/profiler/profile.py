"""What one profiled epoch measured: the :class:`Profile` vector and :class:`EpochMeasurement`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

#: Every named feature of a profile (the profile vector, logged per epoch).
PROFILE_FEATURES: tuple[str, ...] = (
    "op_conv_share",
    "op_matmul_share",
    "op_elementwise_share",
    "op_data_share",
    "op_other_share",
    "cpu_util",
    "log_samples_per_s",
    "log_flops_proxy",  # log of process CPU microseconds per sample
    "ctx_switches_per_step",
    "page_faults_per_step",
    "log_peak_rss_mb",
)

#: The features the ground truth clusters on: what describes the *job* (its operator
#: mix, CPU work per sample, memory footprint) and stays put when the machine is
#: busier or the worker process is fresh. Left out on purpose: wall-clock speed and
#: CPU utilisation (they fall when other trials share the machine) and per-step
#: context switches and page faults (measured for one synthetic job: 44 page faults
#: per step in epoch 1 of a fresh process, 0 in a warm one).
CLUSTER_FEATURES: tuple[str, ...] = (
    "op_conv_share",
    "op_matmul_share",
    "op_elementwise_share",
    "op_data_share",
    "op_other_share",
    "log_flops_proxy",
    "log_peak_rss_mb",
)


@dataclass(frozen=True)
class Profile:
    """A named feature vector of one epoch. ``sources`` says where figures came from,
    e.g. ``{"counters": "perf:software", "energy": "estimate", "op_mix": "torch.profiler"}``."""

    features: dict[str, float]
    sources: dict[str, str] = field(default_factory=dict)

    def vector(self, names: Sequence[str] = PROFILE_FEATURES) -> list[float]:
        missing = [n for n in names if n not in self.features]
        if missing:
            raise KeyError(f"profile lacks features {missing}")
        return [float(self.features[n]) for n in names]

    def to_dict(self) -> dict[str, Any]:
        return {"features": dict(self.features), "sources": dict(self.sources)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        return cls(features={k: float(v) for k, v in data["features"].items()},
                   sources=dict(data.get("sources", {})))


@dataclass(frozen=True)
class EpochMeasurement:
    """Everything the profiler measured around one training epoch.

    ``energy_source`` is ``rapl``, ``nvml`` or ``estimate``; ``counters_source``
    names what the counters came from (``perf:hardware``, ``perf:software`` or
    ``psutil``). ``overhead_s`` is all of the profiler's own time, set-up and read-out
    around the epoch included; ``overhead_in_epoch_s`` the part of it inside
    ``wall_s``, which is what :meth:`cost` takes out.
    """

    wall_s: float
    samples: int
    steps: int
    cpu_s: float
    cpu_util: float
    peak_rss_mb: float
    ctx_switches: int
    page_faults: int
    energy_j: float
    energy_source: str
    counters_source: str
    op_mix: dict[str, float]
    counters: dict[str, float]
    overhead_s: float
    profile: Profile
    overhead_in_epoch_s: float = 0.0
    #: Of ``wall_s``, what the epoch paid once (compiling, recompiling for a new batch
    #: shape, first steps, loader start) beyond ``steps x steady_step_s``.
    one_time_s: float = 0.0
    #: The mean step time once warm (0: not measured, e.g. a record from before it was).
    steady_step_s: float = 0.0
    #: Of ``wall_s``, the time the epoch's thread was ready to run but waited for a CPU
    #: that other work held (Linux schedstat; 0 where not kept). :meth:`cost` takes it
    #: out, and ``one_time_s`` and ``steady_step_s`` are without it: a config is judged
    #: by what it costs, not by what its neighbours did meanwhile.
    cpu_wait_s: float = 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    def cost(self, objective: str) -> float:
        """Cost per sample under the system objective (``time``: s, ``energy``: J).

        The profiler's own time is taken out, pro rata for energy: it is the price of
        measuring, not of the system config, and only the profiled epoch pays much of it.
        For ``time`` so is the time the epoch waited for a CPU (:attr:`own_wall_s`).
        """
        if self.samples <= 0:
            return float("inf")
        if objective == "time":
            return self.own_wall_s / self.samples
        if objective == "energy":
            # The profiler's share of what was metered; waiting for a CPU draws nothing
            # of the epoch's own (a CPU-time estimate) or is metered as it was.
            own = max(self.wall_s - self.overhead_in_epoch_s, 0.0)
            share = own / self.wall_s if self.wall_s > 0 else 1.0
            return self.energy_j * share / self.samples
        raise ValueError(f"objective must be 'time' or 'energy', got {objective!r}")

    @property
    def own_wall_s(self) -> float:
        """The epoch's wall time without the profiler's time inside it and without the
        time it waited for a CPU (``cpu_wait_s``). Only the profiler's time *inside* the
        epoch: set-up and read-out (perf detaching can take seconds) lie outside
        ``wall_s``, and taking them out made a cost of 0."""
        return max(self.wall_s - self.overhead_in_epoch_s - self.cpu_wait_s, 0.0)

    @property
    def cores_busy(self) -> float:
        """CPU seconds per own wall second (:attr:`own_wall_s`), the profiler's own
        time left out: what the epoch kept busy, DataLoader workers included, whatever
        cores it reserved (0 when unknown)."""
        own = self.own_wall_s
        cpu = max(self.cpu_s - self.overhead_in_epoch_s, 0.0)
        return cpu / own if own > 0 else 0.0

    def one_time_cost(self, objective: str) -> float:
        """The epoch's one-time part under the objective, for the whole epoch (``time``:
        s, ``energy``: J pro rata of wall time)."""
        if objective == "time":
            return self.one_time_s
        if objective == "energy":
            return self.energy_j * self.one_time_s / self.wall_s if self.wall_s > 0 else 0.0
        raise ValueError(f"objective must be 'time' or 'energy', got {objective!r}")

    def steady_cost(self, objective: str) -> float:
        """Cost per sample once warm: :meth:`cost` without the one-time part."""
        if self.samples <= 0:
            return float("inf")
        return max(self.cost(objective) - self.one_time_cost(objective) / self.samples, 0.0)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["profile"] = self.profile.to_dict()
        d["samples_per_s"] = self.samples_per_s
        return d
