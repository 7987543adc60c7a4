"""A simulated cluster: the real engine at a scale no machine here has.

:class:`~pipetune.simulate.backend.SimulatedBackend` plays each epoch from a real
study's measured epochs (:class:`~pipetune.simulate.times.EpochTimes`) on a simulated
clock; :func:`~pipetune.simulate.run.simulate` runs a job under PipeTune, V1 and V2
over it and says what each would cost. ``pipetune simulate`` is its command.
"""

from pipetune.simulate.backend import SimulatedBackend
from pipetune.simulate.run import SIMULATED, Cluster, Simulated, simulate, simulate_one
from pipetune.simulate.times import EpochTimes, TimesError

__all__ = ["SIMULATED", "Cluster", "EpochTimes", "Simulated", "SimulatedBackend",
           "TimesError", "simulate", "simulate_one"]
