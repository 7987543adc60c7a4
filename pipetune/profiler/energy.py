"""Energy meters: how many joules an epoch used.

Every meter answers the same contract: ``start()``, then ``stop()`` returns the joules
used since ``start()``; a meter can be started again after it stopped. ``source`` says
what the figure is (``rapl``, ``nvml`` or ``estimate``), so a report never presents an
estimate as a measurement.

>>> meter = EstimateMeter(watts_per_core=10.0)
>>> meter.start()
>>> joules = meter.stop()  # CPU seconds used in between x 10 W
>>> meter.source
'estimate'

:func:`best_meter` picks the most direct meter this machine offers.
"""

from __future__ import annotations

import functools
import os
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from pipetune.errors import SpecError

POWERCAP_ROOT = "/sys/class/powercap"


class EnergyMeter(ABC):
    """Measures the energy used between :meth:`start` and :meth:`stop`."""

    #: What the joules come from: ``rapl``, ``nvml`` or ``estimate``.
    source: ClassVar[str] = ""

    @abstractmethod
    def start(self) -> None:
        """Begin an interval (restarts one already running)."""

    @abstractmethod
    def stop(self) -> float:
        """End the interval and return the joules used in it (>= 0).

        Raises ``RuntimeError`` when the meter was not started.
        """


def _halt_sampler(meter: Any) -> None:
    """Stop a meter's background sampling thread (``_stop_event``, ``_thread``), if any,
    and wait for it: what RAPL's and NVML's meters share."""
    if meter._stop_event is not None:
        meter._stop_event.set()
    if meter._thread is not None:
        meter._thread.join()
    meter._stop_event = meter._thread = None


# -- estimate ----------------------------------------------------------------------------
class EstimateMeter(EnergyMeter):
    """Energy estimated from CPU time: ``CPU seconds x watts_per_core``.

    CPU seconds are those of this process and its children (see
    :mod:`pipetune.profiler.usage`). Idle power and any GPU are not counted, so the
    figure ranks system configs by the CPU work they cost rather than giving a wall
    socket reading.
    """

    source = "estimate"

    def __init__(self, watts_per_core: float = 10.0,
                 cpu_seconds: Callable[[], float] | None = None) -> None:
        _check_positive("profiler.watts_per_core", watts_per_core)
        self.watts_per_core = float(watts_per_core)
        self._cpu_seconds = cpu_seconds
        self._start_cpu: float | None = None

    @property
    def reads_process_cpu(self) -> bool:
        """True when the CPU seconds are this process tree's (no custom reader)."""
        return self._cpu_seconds is None

    def _read(self) -> float:
        if self._cpu_seconds is not None:
            return self._cpu_seconds()
        from pipetune.profiler.usage import process_cpu_seconds

        return process_cpu_seconds()

    def start(self) -> None:
        self._start_cpu = self._read()

    def stop(self) -> float:
        if self._start_cpu is None:
            raise RuntimeError("EstimateMeter.stop() called before start()")
        used = self._read() - self._start_cpu
        self._start_cpu = None
        return max(0.0, used) * self.watts_per_core

    def joules_for(self, cpu_s: float) -> float:
        """The estimate for ``cpu_s`` CPU seconds."""
        return max(0.0, cpu_s) * self.watts_per_core


# -- RAPL --------------------------------------------------------------------------------
class _RaplZone:
    __slots__ = ("name", "energy_path", "max_uj")

    def __init__(self, name: str, energy_path: Path, max_uj: int) -> None:
        self.name = name
        self.energy_path = energy_path
        self.max_uj = max_uj

    def read(self) -> int:
        return int(self.energy_path.read_text().strip())


_TOP_ZONE = re.compile(r"^intel-rapl:\d+$")
_SUB_ZONE = re.compile(r"^intel-rapl:\d+:\d+$")


class RaplMeter(EnergyMeter):
    """CPU package (and DRAM) energy from Linux powercap RAPL counters.

    Reads ``<root>/intel-rapl:N/energy_uj`` for each package zone and the ``dram``
    sub-zones (the package figure excludes DRAM); a ``psys`` zone is skipped when
    package zones exist, as it already contains them. Counters wrap at
    ``max_energy_range_uj``; a background thread folds in the counters every
    ``poll_s`` seconds so an epoch longer than one wrap period is still right
    (``poll_s=None`` disables it; :meth:`poll` does the same by hand).

    ``root`` is the powercap folder (a test points it at a fake one). RAPL counts the
    whole socket, not just this process.
    """

    source = "rapl"

    def __init__(self, root: str | os.PathLike[str] = POWERCAP_ROOT,
                 poll_s: float | None = 30.0) -> None:
        if poll_s is not None:
            _check_positive("profiler.rapl.poll_s", poll_s)
        self.root = Path(root)
        self.poll_s = poll_s
        self._zones: list[_RaplZone] | None = None
        self._last: list[int] | None = None
        self._total_uj = 0
        self._lock: threading.Lock | None = None
        self._stop_event: threading.Event | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def available(cls, root: str | os.PathLike[str] = POWERCAP_ROOT) -> bool:
        """True when at least one RAPL zone exists and its counter is readable."""
        try:
            zones = cls(root, poll_s=None).zones()
            for z in zones:
                z.read()
            return bool(zones)
        except (OSError, ValueError):
            return False

    def zones(self) -> list[_RaplZone]:
        """The zones this meter sums (found once, then cached)."""
        if self._zones is None:
            self._zones = self._discover()
        return self._zones

    def _discover(self) -> list[_RaplZone]:
        if not self.root.is_dir():
            return []
        tops: list[_RaplZone] = []
        subs: list[_RaplZone] = []
        for d in sorted(self.root.iterdir()):
            if not (d / "energy_uj").exists():
                continue
            name = _read_text(d / "name") or d.name
            max_text = _read_text(d / "max_energy_range_uj")
            zone = _RaplZone(name, d / "energy_uj", int(max_text) if max_text else 0)
            if _TOP_ZONE.match(d.name):
                tops.append(zone)
            elif _SUB_ZONE.match(d.name) and name.startswith("dram"):
                subs.append(zone)
        if any(z.name.startswith("package") for z in tops):
            tops = [z for z in tops if z.name != "psys"]
        return tops + subs

    def _delta(self, zone: _RaplZone, before: int, now: int) -> int:
        if now >= before:
            return now - before
        if zone.max_uj > 0:
            return zone.max_uj - before + now
        return now  # no range known: assume the counter restarted from zero

    def poll(self) -> None:
        """Fold the counters' movement since the last read into the running total."""
        lock = self._lock
        if lock is None:
            return
        with lock:
            if self._last is None:
                return
            now = [z.read() for z in self.zones()]
            self._total_uj += sum(
                self._delta(z, b, n) for z, b, n in zip(self.zones(), self._last, now,
                                                        strict=True)
            )
            self._last = now

    def start(self) -> None:
        _halt_sampler(self)
        zones = self.zones()
        if not zones:
            raise RuntimeError(f"no readable RAPL zones under {self.root}")
        self._lock = threading.Lock()
        self._total_uj = 0
        self._last = [z.read() for z in zones]
        if self.poll_s is not None:
            self._stop_event = threading.Event()
            self._thread = threading.Thread(
                target=self._poll_loop, args=(self._stop_event, self.poll_s),
                name="pipetune-rapl", daemon=True,
            )
            self._thread.start()

    def _poll_loop(self, stop_event: threading.Event, every: float) -> None:
        while not stop_event.wait(every):
            try:
                self.poll()
            except (OSError, ValueError):
                return

    def stop(self) -> float:
        if self._last is None:
            raise RuntimeError("RaplMeter.stop() called before start()")
        _halt_sampler(self)
        self.poll()
        total = self._total_uj
        self._last = None
        self._lock = None
        return total / 1e6

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_lock=None, _stop_event=None, _thread=None, _last=None, _total_uj=0)
        return state


def _read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


# -- NVML --------------------------------------------------------------------------------
class NvmlMeter(EnergyMeter):
    """GPU board energy from NVML (``pynvml``, from the ``nvidia-ml-py`` package).

    Uses ``nvmlDeviceGetTotalEnergyConsumption`` (millijoules since driver load, Volta
    and newer); on GPUs without it, samples ``nvmlDeviceGetPowerUsage`` every
    ``sample_s`` seconds in a thread and integrates. Counts the GPU only, not the CPU.

    ``device_index`` is the CUDA index as this process sees it; it is mapped through
    ``CUDA_VISIBLE_DEVICES`` to NVML's numbering. ``nvml`` replaces the ``pynvml``
    module (for tests).
    """

    source = "nvml"

    def __init__(self, device_index: int = 0, *, sample_s: float = 0.1,
                 nvml: Any = None) -> None:
        if not isinstance(device_index, int) or device_index < 0:
            raise SpecError("profiler.device", f"CUDA index must be >= 0, got {device_index!r}")
        _check_positive("profiler.nvml.sample_s", sample_s)
        self.device_index = device_index
        self.sample_s = sample_s
        self._nvml_override = nvml
        self._mode: str | None = None
        self._handle: Any = None
        self._start_mj = 0
        self._samples: list[tuple[float, float]] = []
        self._stop_event: threading.Event | None = None
        self._thread: threading.Thread | None = None

    @staticmethod
    def _import_nvml() -> Any:
        import pynvml  # noqa: PLC0415 - optional dependency

        return pynvml

    @classmethod
    def available(cls, device_index: int = 0, nvml: Any = None) -> bool:
        """True when NVML loads and the device exists."""
        try:
            lib = nvml if nvml is not None else cls._import_nvml()
            lib.nvmlInit()
        except Exception:  # noqa: BLE001 - no module, no driver, no GPU: all mean "no"
            return False
        try:
            cls(device_index, nvml=lib)._get_handle(lib)
            return True
        except Exception:  # noqa: BLE001
            return False
        finally:
            try:
                lib.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass

    def _lib(self) -> Any:
        return self._nvml_override if self._nvml_override is not None else self._import_nvml()

    def _get_handle(self, lib: Any) -> Any:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        entries = [e.strip() for e in visible.split(",") if e.strip()] if visible else []
        if entries and self.device_index < len(entries):
            entry = entries[self.device_index]
            if entry.isdigit():
                return lib.nvmlDeviceGetHandleByIndex(int(entry))
            return lib.nvmlDeviceGetHandleByUUID(entry)
        return lib.nvmlDeviceGetHandleByIndex(self.device_index)

    def start(self) -> None:
        _halt_sampler(self)
        lib = self._lib()
        lib.nvmlInit()
        self._handle = self._get_handle(lib)
        try:
            self._start_mj = int(lib.nvmlDeviceGetTotalEnergyConsumption(self._handle))
            self._mode = "counter"
        except Exception:  # noqa: BLE001 - NVMLError_NotSupported on older GPUs
            self._mode = "power"
            self._samples = [(time.perf_counter(), self._power_w(lib))]
            self._stop_event = threading.Event()
            self._thread = threading.Thread(
                target=self._sample_loop, args=(lib, self._stop_event),
                name="pipetune-nvml", daemon=True,
            )
            self._thread.start()

    def _power_w(self, lib: Any) -> float:
        return float(lib.nvmlDeviceGetPowerUsage(self._handle)) / 1000.0

    def _sample_loop(self, lib: Any, stop_event: threading.Event) -> None:
        while not stop_event.wait(self.sample_s):
            try:
                self._samples.append((time.perf_counter(), self._power_w(lib)))
            except Exception:  # noqa: BLE001 - keep what was sampled so far
                return

    def stop(self) -> float:
        if self._mode is None:
            raise RuntimeError("NvmlMeter.stop() called before start()")
        lib = self._lib()
        try:
            if self._mode == "counter":
                now = int(lib.nvmlDeviceGetTotalEnergyConsumption(self._handle))
                return max(0, now - self._start_mj) / 1000.0
            _halt_sampler(self)
            self._samples.append((time.perf_counter(), self._power_w(lib)))
            return _trapezoid(self._samples)
        finally:
            self._mode = None
            self._handle = None
            try:
                lib.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_mode=None, _handle=None, _samples=[], _stop_event=None, _thread=None)
        return state


def _trapezoid(samples: list[tuple[float, float]]) -> float:
    """Integral of (time s, power W) samples, in joules."""
    pairs = zip(samples, samples[1:], strict=False)
    return sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in pairs)


# -- choosing ----------------------------------------------------------------------------
def cuda_index(device: str) -> int | None:
    """The CUDA index of a device string (``cuda`` -> 0, ``cuda:1`` -> 1), None for CPU."""
    if device == "cpu":
        return None
    m = re.fullmatch(r"cuda(?::(\d+))?", device)
    if not m:
        raise SpecError("profiler.device", f"must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return int(m.group(1) or 0)


def best_meter(device: str = "cpu", watts_per_core: float = 10.0, *,
               powercap_root: str | os.PathLike[str] = POWERCAP_ROOT) -> EnergyMeter:
    """The most direct meter available: NVML for a CUDA device, else RAPL, else estimate.

    What is available is checked once per process (per device index and powercap root).
    """
    index = cuda_index(device)
    if index is not None and _nvml_available(index):
        return NvmlMeter(index)
    if _rapl_available(str(powercap_root)):
        return RaplMeter(powercap_root)
    return EstimateMeter(watts_per_core)


# Checked once per process: a profiler is often built per epoch task, and starting NVML
# takes a noticeable fraction of a second on a GPU machine.
@functools.cache
def _nvml_available(index: int) -> bool:
    return NvmlMeter.available(index)


@functools.cache
def _rapl_available(root: str) -> bool:
    return RaplMeter.available(root)


def _check_positive(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise SpecError(field, f"must be a number > 0, got {value!r}")
