"""System knobs: the config value, the machine it must fit, and applying it."""

from pipetune.system.apply import applied_system_config, autocast_for
from pipetune.system.config import KNOBS, MachineInfo, SystemConfig

__all__ = ["KNOBS", "MachineInfo", "SystemConfig", "applied_system_config", "autocast_for"]
