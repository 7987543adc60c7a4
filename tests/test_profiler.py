"""The epoch profiler measuring real (tiny) torch training loops, and its pure parts."""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
import time

import psutil
import pytest

from pipetune.errors import SpecError
from pipetune.profiler import (
    OP_CATEGORIES,
    PROFILE_FEATURES,
    EnergyMeter,
    EpochProfiler,
    EstimateMeter,
    classify_op,
    parse_perf_csv,
    perf_support,
)
from pipetune.profiler.opmix import op_shares_from_spans
from pipetune.profiler.perf_events import KernelCounters, kernel_support
from pipetune.workloads._base import TrainStats

torch = pytest.importorskip("torch")
nn = torch.nn

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def make_train(kind: str = "conv", samples: int = 192, batch: int = 16):
    """A plain training function of the shape the profiler takes: ``train(hook)``."""
    gen = torch.Generator().manual_seed(0)
    if kind == "conv":
        x = torch.randn(samples, 1, 12, 12, generator=gen)
        model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(),
                              nn.Linear(4 * 10 * 10, 10))
    else:
        x = torch.randn(samples, 32, generator=gen)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    y = torch.randint(0, 10, (samples,), generator=gen)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def train(hook):
        total = seen = steps = 0
        for xb, yb in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            total += loss.item() * len(xb)
            seen += len(xb)
            steps += 1
            if hook is not None:
                hook()
        return TrainStats(total / seen, seen, steps)

    return train


@pytest.fixture(scope="module")
def conv_result():
    profiler = EpochProfiler(op_mix_steps=3, watts_per_core=7.5, energy_meter=EstimateMeter(7.5))
    return profiler.measure(make_train("conv"))


def test_conv_epoch_measures_plausible_figures(conv_result):
    stats, m = conv_result
    assert (stats.samples, stats.steps) == (192, 12)
    assert (m.samples, m.steps) == (192, 12)
    assert m.wall_s > 0 and m.cpu_s > 0
    assert 0 < m.cpu_util <= 1.1
    assert m.peak_rss_mb > 10  # torch alone is bigger than that
    assert m.ctx_switches >= 0 and m.page_faults >= 0
    assert m.overhead_s >= 0
    assert m.counters["cpu_s"] == m.cpu_s
    assert m.samples_per_s == pytest.approx(192 / m.wall_s)


def test_conv_epoch_op_mix_sums_to_one_with_conv_share(conv_result):
    _, m = conv_result
    assert set(m.op_mix) == set(OP_CATEGORIES)
    assert sum(m.op_mix.values()) == pytest.approx(1.0)
    assert m.op_mix["conv"] > 0
    assert m.op_mix["matmul"] > 0  # the Linear head
    assert m.profile.sources["op_mix"] == "torch.profiler(3 steps)"


def test_profile_has_every_feature_and_they_follow_from_the_measurement(conv_result):
    _, m = conv_result
    f = m.profile.features
    assert set(f) == set(PROFILE_FEATURES)
    assert all(math.isfinite(v) for v in f.values())
    assert m.profile.vector() == [f[n] for n in PROFILE_FEATURES]
    for k in OP_CATEGORIES:
        assert f[f"op_{k}_share"] == m.op_mix[k]
    assert f["cpu_util"] == m.cpu_util
    assert f["log_samples_per_s"] == pytest.approx(math.log1p(m.samples / m.wall_s))
    assert f["log_flops_proxy"] == pytest.approx(math.log1p(1e6 * m.cpu_s / m.samples))
    assert f["ctx_switches_per_step"] == pytest.approx(m.ctx_switches / m.steps)
    assert f["page_faults_per_step"] == pytest.approx(m.page_faults / m.steps)
    assert f["log_peak_rss_mb"] == pytest.approx(math.log1p(m.peak_rss_mb))


def test_estimate_energy_is_cpu_seconds_times_watts(conv_result):
    _, m = conv_result
    assert m.energy_source == "estimate"
    assert m.profile.sources["energy"] == "estimate"
    assert m.energy_j == pytest.approx(m.cpu_s * 7.5)
    # The profiler's own share of the epoch is not the config's cost; its set-up and
    # read-out (perf detaching, outside wall_s) are not taken out of the epoch.
    assert 0 <= m.overhead_in_epoch_s <= m.overhead_s
    own = (m.wall_s - m.overhead_in_epoch_s) / m.wall_s
    assert 0 < own <= 1
    assert m.cost("energy") == pytest.approx(m.energy_j * own / 192)
    assert 0 <= m.cpu_wait_s <= m.wall_s - m.overhead_in_epoch_s
    assert m.cost("time") == pytest.approx(
        (m.wall_s - m.overhead_in_epoch_s - m.cpu_wait_s) / 192)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity")
                    or not os.path.exists("/proc/thread-self/schedstat"),
                    reason="needs Linux CPU affinity and schedstat")
def test_time_an_epoch_waited_for_a_cpu_is_left_out_of_its_cost():
    """Pinned to one CPU beside a process burning it, an epoch takes about twice its
    own time: the wait is measured and its cost is what it would take alone."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    before = os.sched_getaffinity(0)
    train = make_train("conv", samples=8192, batch=64)
    profiler = EpochProfiler(energy_meter=EstimateMeter(7.5))
    os.sched_setaffinity(0, {cpu})  # this thread only: torch's other threads stay put
    try:
        torch.set_num_threads(1)
        _, alone = profiler.measure(train, profile_ops=False)
        # Not our child (its parent exits): the epoch's CPU counts its own children.
        spawn = ("import subprocess, sys\n"
                 f"print(subprocess.Popen([sys.executable, '-c', {BURN.format(s=60)!r}],"
                 " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")
        burner = int(subprocess.run([sys.executable, "-c", spawn], capture_output=True,
                                    text=True, check=True).stdout)
        try:
            os.sched_setaffinity(burner, {cpu})
            time.sleep(0.2)
            _, shared = profiler.measure(train, profile_ops=False)
        finally:
            psutil.Process(burner).kill()
    finally:
        os.sched_setaffinity(0, before)
    assert shared.cpu_wait_s > 0.3 * shared.wall_s  # about half: one CPU, two runners
    assert shared.wall_s > 1.5 * alone.wall_s
    # Its own time is the time it ran (one thread: its CPU time), nowhere near the
    # doubled wall time. (Compared within the run: beside the burner the same steps
    # take more CPU, the caches shared, so a bound against the run alone is noise.)
    assert shared.own_wall_s == pytest.approx(shared.cpu_s, rel=0.3)
    assert shared.own_wall_s < 0.75 * shared.wall_s
    assert shared.cost("time") == pytest.approx(shared.own_wall_s / shared.samples)
    assert shared.steady_step_s * shared.steps < 0.75 * shared.wall_s  # the wait left out
    assert 0.5 < shared.cores_busy < 1.3  # one thread, busy whenever it ran


def test_counters_source_matches_what_perf_can_do_here(conv_result):
    _, m = conv_result
    kernel = kernel_support()
    level = kernel or perf_support()
    assert m.profile.sources["counters"] == m.counters_source
    if level is None:
        assert m.counters_source == "psutil"
    elif kernel is not None:  # counted from the epoch's first instant
        assert m.counters_source == f"perf:{kernel}"
    else:
        # A very short epoch may end before perf attached; then psutil is reported.
        assert m.counters_source in (f"perf:{level}", "psutil")
    if m.counters_source.startswith("perf:"):
        assert m.counters["perf:task-clock"] > 0


@pytest.mark.skipif(kernel_support() is None, reason="the kernel counts no perf event here")
def test_kernel_counters_count_every_thread_from_the_start_without_a_process():
    """perf_event_open on each thread (new threads inherit): the task clock of a busy
    main thread and of a thread started afterwards is the CPU time they used."""
    import threading

    def spin(seconds: float) -> None:
        t = time.thread_time()
        while time.thread_time() - t < seconds:
            pass

    counters = KernelCounters(os.getpid(), kernel_support())
    before = psutil.Process().children()
    cpu = time.process_time()
    assert counters.start()
    spin(0.2)
    later = threading.Thread(target=spin, args=(0.2,))
    later.start()
    later.join()
    counts = counters.stop()
    used = time.process_time() - cpu
    assert psutil.Process().children() == before  # no perf process
    assert counts is not None and counts.values["page-faults"] >= 0
    assert 0.35 <= counts.values["task-clock"] / 1000 <= used + 0.05


def test_mlp_epoch_is_matmul_without_conv():
    _, m = EpochProfiler(perf="off").measure(make_train("mlp"))
    assert m.op_mix["matmul"] > 0
    assert m.op_mix["conv"] == 0
    assert sum(m.op_mix.values()) == pytest.approx(1.0)
    assert m.counters_source == "psutil"


def test_without_op_profiling_shares_are_zero_and_source_says_off():
    _, m = EpochProfiler(perf="off").measure(make_train("mlp"), profile_ops=False)
    assert set(m.op_mix.values()) == {0.0}
    assert m.profile.sources["op_mix"] == "off"
    assert m.cpu_s > 0


def test_short_epoch_uses_the_steps_there_are():
    # 3 steps: two are skipped, one is traced.
    _, m = EpochProfiler(perf="off", op_mix_steps=5).measure(make_train("mlp", samples=48))
    assert m.steps == 3
    assert m.profile.sources["op_mix"] == "torch.profiler(1 steps)"
    assert sum(m.op_mix.values()) == pytest.approx(1.0)


def test_epoch_too_short_to_trace_gives_zero_shares_and_a_note():
    _, m = EpochProfiler(perf="off").measure(make_train("mlp", samples=32))
    assert m.steps == 2
    assert set(m.op_mix.values()) == {0.0}
    assert m.profile.sources["op_mix"].startswith("none: the epoch had 2 steps")


def perf_children() -> list[psutil.Process]:
    return [c for c in psutil.Process().children() if c.name() == "perf"]


def test_failing_epoch_propagates_and_profiler_still_works_after():
    profiler = EpochProfiler(op_mix_steps=3)
    train = make_train("mlp")

    def broken(hook):
        for _ in range(4):
            hook()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        profiler.measure(broken)
    assert perf_children() == []
    _, m = profiler.measure(train)
    assert m.profile.sources["op_mix"] == "torch.profiler(3 steps)"


class BrokenMeter(EnergyMeter):
    """A meter whose sensor fails to open (a powercap file that vanished)."""

    source = "rapl"

    def start(self) -> None:
        raise OSError("energy_uj: no such file")

    def stop(self) -> float:
        raise AssertionError("never started")


def test_failing_setup_leaves_no_perf_process_behind():
    with pytest.raises(OSError, match="energy_uj"):
        EpochProfiler(energy_meter=BrokenMeter()).measure(make_train("mlp"))
    assert perf_children() == []


def test_cpu_of_child_processes_is_counted():
    """One child exits within the epoch (reaped), one keeps running past it (live)."""
    live = []

    def train(hook):
        subprocess.run([sys.executable, "-c", BURN.format(s=0.3)], check=True)
        child = subprocess.Popen(
            [sys.executable, "-c", BURN.format(s=0.3) + "import sys; sys.stdin.read()"],
            stdin=subprocess.PIPE,
        )
        live.append(child)
        # Wait until the live child has burnt its CPU, without burning any here.
        proc = psutil.Process(child.pid)
        deadline = time.monotonic() + 60
        while sum(proc.cpu_times()[:2]) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.02)
        return TrainStats(0.0, 1, 1)

    try:
        _, m = EpochProfiler(perf="off").measure(train, profile_ops=False)
    finally:
        for child in live:
            child.communicate(b"")
    assert m.cpu_s >= 0.55  # 0.3 s in each child, this process mostly waits


def test_peak_rss_is_the_epochs_own_peak():
    from pipetune.profiler.usage import reset_peak_rss

    if not reset_peak_rss():
        pytest.skip("this kernel does not let a process reset its peak RSS")

    def allocating(hook):
        block = torch.ones(75_000_000)  # 300 MB, every page written
        del block
        return TrainStats(0.0, 1, 1)

    profiler = EpochProfiler(perf="off")
    _, big = profiler.measure(allocating, profile_ops=False)
    _, small = profiler.measure(make_train("mlp", samples=64), profile_ops=False)
    assert big.peak_rss_mb >= small.peak_rss_mb + 100


def test_profiler_pickles_for_dask_workers():
    profiler = EpochProfiler(op_mix_steps=2, perf="off", watts_per_core=3.0)
    profiler.measure(make_train("mlp", samples=64))  # resolves the energy meter
    clone = pickle.loads(pickle.dumps(profiler))
    assert (clone.op_mix_steps, clone.perf, clone.watts_per_core) == (2, "off", 3.0)
    _, m = clone.measure(make_train("mlp", samples=64))
    assert m.samples == 64


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"op_mix_steps": 0}, "profiler.op_mix_steps"),
        ({"op_mix_steps": True}, "profiler.op_mix_steps"),
        ({"perf": "on"}, "profiler.perf"),
        ({"watts_per_core": 0}, "profiler.watts_per_core"),
        ({"device": "tpu"}, "profiler.device"),
        ({"energy_meter": "rapl"}, "profiler.energy_meter"),
    ],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(SpecError) as err:
        EpochProfiler(**kwargs)
    assert err.value.field == field


# -- pure parts ------------------------------------------------------------------------
PERF_SAMPLE = """\
# started on Wed Dec  2 17:02:09 2026

<not supported>,,cycles,0,100.00,,
<not supported>,,instructions,0,100.00,,
<not counted>,,cache-misses:u,0,0.00,,
2957.20,msec,task-clock,2957185721,100.00,0.713,CPUs utilized
830,,context-switches,2957185721,100.00,280.672,/sec
1,,cpu-migrations,2957185721,100.00,0.338,/sec
8286,,page-faults,2957185721,100.00,2.802,K/sec
"""


def test_parse_perf_csv_separates_counted_and_unsupported_events():
    counts = parse_perf_csv(PERF_SAMPLE)
    assert counts.values == {
        "task-clock": 2957.2,
        "context-switches": 830.0,
        "cpu-migrations": 1.0,
        "page-faults": 8286.0,
    }
    assert counts.unsupported == {"cycles", "instructions", "cache-misses"}


def test_parse_perf_csv_of_hardware_counters_and_garbage():
    text = "1234567,,cycles:u,100,100.00,0.5,GHz\n987,,instructions,100,50.00,,\nnot csv\n,,\n"
    counts = parse_perf_csv(text)
    assert counts.values == {"cycles": 1234567.0, "instructions": 987.0}
    assert counts.unsupported == frozenset()
    assert parse_perf_csv("").values == {}


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("aten::conv2d", "conv"),
        ("aten::mkldnn_convolution", "conv"),
        ("aten::cudnn_convolution", "conv"),
        ("aten::convolution_backward", "conv"),
        ("autograd::engine::evaluate_function: ConvolutionBackward0", "conv"),
        ("aten::mm", "matmul"),
        ("aten::addmm", "matmul"),
        ("aten::bmm", "matmul"),
        ("aten::linear", "matmul"),
        ("AddmmBackward0", "matmul"),
        ("aten::add_", "elementwise"),
        ("aten::relu", "elementwise"),
        ("aten::threshold_backward", "elementwise"),
        ("aten::tanh", "elementwise"),
        ("aten::_softmax", "elementwise"),
        ("aten::dropout", "elementwise"),
        ("aten::max_pool2d_with_indices", "elementwise"),
        ("MaxPool2DWithIndicesBackward0", "elementwise"),
        ("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "data"),
        ("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", "data"),
        ("aten::conv1d", "conv"),
        ("aten::slow_conv2d_forward", "conv"),
        ("aten::_convert_indices_from_coo_to_csr", None),
        ("aten::lstm", "matmul"),
        ("aten::_scaled_dot_product_flash_attention", "matmul"),
        ("aten::native_batch_norm", "elementwise"),
        ("aten::nll_loss_forward", "elementwise"),
        ("aten::view", None),
        ("aten::expand", None),
        ("aten::copy_", None),
        ("Optimizer.step#SGD.step", None),
        ("pipetune::step", None),
    ],
)
def test_classify_op(name, category):
    assert classify_op(name) == category


def test_shares_from_spans_use_self_time_and_inherit_categories():
    spans = [
        # thread 1: a step with a data fetch, a matmul whose child view inherits matmul
        ("pipetune::step", 1, 0, 1000),
        ("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 1, 0, 200),
        ("aten::relu", 1, 50, 150),  # under data: data, not elementwise
        ("aten::addmm", 1, 200, 600),
        ("aten::t", 1, 250, 350),  # no category of its own: inherits matmul
        ("aten::conv2d", 1, 600, 900),
        # thread 2: a lone elementwise op (a backward thread)
        ("aten::mul", 2, 0, 100),
    ]
    shares = op_shares_from_spans(spans)
    total = 1100
    assert shares == pytest.approx({
        "conv": 300 / total,
        "matmul": 400 / total,
        "elementwise": 100 / total,
        "data": 200 / total,
        "other": 100 / total,  # the step's own time: 1000 - 200 - 400 - 300
    })
    assert op_shares_from_spans([]) == dict.fromkeys(OP_CATEGORIES, 0.0)
