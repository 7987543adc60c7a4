"""Profiling one training epoch: the profile vector, OS and perf counters, energy.

:class:`EpochProfiler` measures an epoch; :class:`Profile` is the feature vector the
ground truth clusters on; energy meters say how many joules an epoch used.
"""

from pipetune.profiler._profiler import EpochProfiler
from pipetune.profiler.energy import (
    EnergyMeter,
    EstimateMeter,
    NvmlMeter,
    RaplMeter,
    best_meter,
)
from pipetune.profiler.opmix import OP_CATEGORIES, classify_op, op_shares
from pipetune.profiler.perf import parse_perf_csv, perf_support
from pipetune.profiler.profile import PROFILE_FEATURES, EpochMeasurement, Profile

__all__ = [
    "OP_CATEGORIES",
    "PROFILE_FEATURES",
    "EnergyMeter",
    "EpochMeasurement",
    "EpochProfiler",
    "EstimateMeter",
    "NvmlMeter",
    "Profile",
    "RaplMeter",
    "best_meter",
    "classify_op",
    "op_shares",
    "parse_perf_csv",
    "perf_support",
]
