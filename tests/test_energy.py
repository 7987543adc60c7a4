"""Energy meters: one contract over every meter, RAPL on a fake powercap folder, NVML on a
fake NVML library, and the choice :func:`best_meter` makes on this machine."""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import pytest

from pipetune.errors import SpecError
from pipetune.profiler import EnergyMeter, EstimateMeter, NvmlMeter, RaplMeter, best_meter

MAX_UJ = 1_000_000


def burn_cpu(seconds: float) -> None:
    t = time.process_time()
    while time.process_time() - t < seconds:
        pass


class FakePowercap:
    """A powercap folder as the kernel lays it out, with counters the test sets."""

    def __init__(self, root: Path, zones: dict[str, str]) -> None:
        self.root = root
        for folder, name in zones.items():
            d = root / folder
            d.mkdir(parents=True)
            (d / "name").write_text(name + "\n")
            (d / "max_energy_range_uj").write_text(f"{MAX_UJ}\n")
            (d / "energy_uj").write_text("0\n")

    def set(self, folder: str, uj: int) -> None:
        (self.root / folder / "energy_uj").write_text(f"{uj}\n")

    def add(self, folder: str, uj: int) -> None:
        """Advance a counter by ``uj``, wrapping like the hardware does."""
        now = int((self.root / folder / "energy_uj").read_text())
        self.set(folder, (now + uj) % MAX_UJ)


@pytest.fixture
def powercap(tmp_path) -> FakePowercap:
    return FakePowercap(tmp_path / "powercap", {
        "intel-rapl:0": "package-0",
        "intel-rapl:0:0": "core",  # inside the package figure: not added again
        "intel-rapl:0:1": "dram",  # outside it: added
        "intel-rapl:1": "package-1",
        "intel-rapl:2": "psys",  # the whole platform: would count the packages twice
    })


class FakeNvml:
    """The slice of the NVML library (``pynvml``) the meter calls, on a pretend GPU."""

    class NVMLError(Exception):
        pass

    def __init__(self, *, has_energy_counter: bool = True, watts: float = 250.0) -> None:
        self.has_energy_counter = has_energy_counter
        self.watts = watts
        self.energy_mj = 5_000_000
        self.inits = 0

    def nvmlInit(self):  # noqa: N802 - NVML's names
        self.inits += 1

    def nvmlShutdown(self):  # noqa: N802
        self.inits -= 1

    def nvmlDeviceGetHandleByIndex(self, index):  # noqa: N802
        if index != 0:
            raise self.NVMLError("invalid device")
        return "gpu0"

    def nvmlDeviceGetHandleByUUID(self, uuid):  # noqa: N802
        raise self.NVMLError("not found")

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):  # noqa: N802
        if not self.has_energy_counter:
            raise self.NVMLError("not supported")
        return self.energy_mj

    def nvmlDeviceGetPowerUsage(self, handle):  # noqa: N802
        return int(self.watts * 1000)


# -- one contract, every meter ---------------------------------------------------------
@pytest.fixture(params=["estimate", "rapl-fake", "nvml-fake"])
def meter_and_work(request, powercap, monkeypatch):
    """A meter and a function doing 'work' it will see, with the joules it should report
    at least."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if request.param == "estimate":
        return EstimateMeter(20.0), lambda: burn_cpu(0.05), 0.05 * 20.0 * 0.5
    if request.param == "rapl-fake":
        def work():
            powercap.add("intel-rapl:0", 300_000)
        return RaplMeter(powercap.root, poll_s=None), work, 0.3
    nvml = FakeNvml()

    def gpu_work():
        nvml.energy_mj += 1500
    return NvmlMeter(0, nvml=nvml), gpu_work, 1.5


def test_meter_contract(meter_and_work):
    meter, work, at_least = meter_and_work
    assert isinstance(meter, EnergyMeter)
    assert meter.source in ("estimate", "rapl", "nvml")
    with pytest.raises(RuntimeError):
        meter.stop()
    meter.start()
    work()
    first = meter.stop()
    assert isinstance(first, float)
    assert first >= at_least
    with pytest.raises(RuntimeError):
        meter.stop()  # an interval ends once
    # Idle meters pickle (they travel to Dask workers) and work again afterwards.
    clone = pickle.loads(pickle.dumps(meter))
    assert clone.source == meter.source
    meter.start()
    second = meter.stop()
    assert 0.0 <= second < at_least


# -- estimate ----------------------------------------------------------------------------
def test_estimate_is_cpu_seconds_times_watts():
    clock = iter([10.0, 12.5])
    meter = EstimateMeter(8.0, cpu_seconds=lambda: next(clock))
    meter.start()
    assert meter.stop() == pytest.approx(2.5 * 8.0)
    assert meter.joules_for(1.5) == 12.0


def test_estimate_on_real_cpu_time():
    meter = EstimateMeter(10.0)
    meter.start()
    burn_cpu(0.2)
    assert meter.stop() >= 0.2 * 10.0 * 0.9  # tick granularity, never much less


@pytest.mark.parametrize("watts", [0, -1, True, "10"])
def test_estimate_rejects_bad_watts(watts):
    with pytest.raises(SpecError) as err:
        EstimateMeter(watts)
    assert err.value.field == "profiler.watts_per_core"


# -- RAPL --------------------------------------------------------------------------------
def test_rapl_sums_packages_and_dram_but_not_core_or_psys(powercap):
    meter = RaplMeter(powercap.root, poll_s=None)
    assert sorted(z.name for z in meter.zones()) == ["dram", "package-0", "package-1"]
    meter.start()
    powercap.add("intel-rapl:0", 100_000)
    powercap.add("intel-rapl:1", 200_000)
    powercap.add("intel-rapl:0:1", 50_000)
    powercap.add("intel-rapl:0:0", 999_999)  # core: ignored
    powercap.add("intel-rapl:2", 999_999)  # psys: ignored
    assert meter.stop() == pytest.approx(0.35)


def test_rapl_handles_wraparound(powercap):
    powercap.set("intel-rapl:0", MAX_UJ - 100_000)
    meter = RaplMeter(powercap.root, poll_s=None)
    meter.start()
    powercap.add("intel-rapl:0", 250_000)  # wraps to 150_000
    assert int((powercap.root / "intel-rapl:0" / "energy_uj").read_text()) == 150_000
    assert meter.stop() == pytest.approx(0.25)


def test_rapl_poll_keeps_count_across_several_wraps(powercap):
    meter = RaplMeter(powercap.root, poll_s=None)
    meter.start()
    for _ in range(3):  # 3 x 0.9 J > one counter range (1 J)
        powercap.add("intel-rapl:0", 900_000)
        meter.poll()
    assert meter.stop() == pytest.approx(2.7)


def test_rapl_background_poll_thread_stops_with_the_meter(powercap):
    meter = RaplMeter(powercap.root, poll_s=0.01)
    meter.start()
    powercap.add("intel-rapl:1", 400_000)
    assert meter.stop() == pytest.approx(0.4)
    assert meter._thread is None


def test_rapl_availability(powercap, tmp_path):
    assert RaplMeter.available(powercap.root)
    assert not RaplMeter.available(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not RaplMeter.available(empty)
    with pytest.raises(RuntimeError, match="no readable RAPL zones"):
        RaplMeter(empty).start()


# -- NVML --------------------------------------------------------------------------------
def test_nvml_counter_is_millijoules(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNvml()
    meter = NvmlMeter(0, nvml=nvml)
    meter.start()
    nvml.energy_mj += 42_000
    assert meter.stop() == pytest.approx(42.0)
    assert nvml.inits == 0  # every init was shut down


def test_nvml_without_energy_counter_integrates_power(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    meter = NvmlMeter(0, nvml=FakeNvml(has_energy_counter=False, watts=100.0), sample_s=0.01)
    t0 = time.perf_counter()
    meter.start()
    time.sleep(0.05)
    joules = meter.stop()
    elapsed = time.perf_counter() - t0
    # Constant 100 W: the integral is 100 W x the sampled span, which lies inside the
    # interval this test timed.
    assert 0 < joules <= 100.0 * elapsed


def test_nvml_maps_cuda_visible_devices(monkeypatch):
    nvml = FakeNvml()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert NvmlMeter.available(0, nvml=nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # this process's cuda:0 is NVML's 3
    assert not NvmlMeter.available(0, nvml=nvml)


def test_nvml_unavailable_without_library():
    # Whether or not pynvml is installed, there is no GPU driver on this machine.
    assert NvmlMeter.available(5) is False


# -- choosing --------------------------------------------------------------------------
def test_best_meter_here_is_the_estimate():
    if RaplMeter.available():
        pytest.skip("this machine exposes RAPL")
    meter = best_meter("cpu", 12.0)
    assert isinstance(meter, EstimateMeter)
    assert meter.watts_per_core == 12.0
    assert isinstance(best_meter("cuda", 12.0), EstimateMeter)  # no NVML here


def test_best_meter_prefers_rapl_when_present(powercap):
    meter = best_meter("cpu", powercap_root=powercap.root)
    assert isinstance(meter, RaplMeter)
    assert meter.source == "rapl"


def test_best_meter_rejects_unknown_device():
    with pytest.raises(SpecError) as err:
        best_meter("tpu")
    assert err.value.field == "profiler.device"
