"""What one profiled epoch measured: the :class:`Profile` vector and :class:`EpochMeasurement`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

#: Features the ground truth clusters on. They describe the *job* (its operator mix,
#: how it uses the CPU and memory per step, its speed) as seen under the default
#: system config in epoch 1, so profiles of the same model with other learning rates
#: land together and other models land apart.
PROFILE_FEATURES: tuple[str, ...] = (
    "op_conv_share",
    "op_matmul_share",
    "op_elementwise_share",
    "op_data_share",
    "op_other_share",
    "cpu_util",
    "log_samples_per_s",
    "log_flops_proxy",  # log of process CPU seconds per sample
    "ctx_switches_per_step",
    "page_faults_per_step",
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
    ``psutil``). ``overhead_s`` is the profiler's own time inside the epoch.
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

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    def cost(self, objective: str) -> float:
        """Cost per sample under the system objective (``time``: s, ``energy``: J)."""
        if self.samples <= 0:
            return float("inf")
        if objective == "time":
            return self.wall_s / self.samples
        if objective == "energy":
            return self.energy_j / self.samples
        raise ValueError(f"objective must be 'time' or 'energy', got {objective!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["profile"] = self.profile.to_dict()
        d["samples_per_s"] = self.samples_per_s
        return d
