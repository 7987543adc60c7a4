"""SystemConfig checks itself, names the knob it rejects, and applying it is undone."""

from __future__ import annotations

import os
import pickle

import pytest

from pipetune.errors import SpecError, SystemConfigError
from pipetune.system import KNOBS, MachineInfo, SystemConfig, applied_system_config, autocast_for


@pytest.mark.parametrize(
    ("knobs", "field"),
    [
        ({"cores": 0}, "system.cores"),
        ({"cores": 1.5}, "system.cores"),
        ({"interop_threads": True}, "system.interop_threads"),
        ({"dataloader_workers": -1}, "system.dataloader_workers"),
        ({"device": "tpu"}, "system.device"),
        ({"device": "cuda", "precision": "fp8"}, "system.precision"),
        ({"device": "cuda", "tf32": "yes"}, "system.tf32"),
    ],
)
def test_invalid_values_name_the_knob(knobs, field):
    with pytest.raises(SystemConfigError) as info:
        SystemConfig(**knobs)
    assert info.value.field == field
    assert isinstance(info.value, SpecError) and str(info.value).startswith(field)


@pytest.mark.parametrize("knob", ["tf32", "cudnn_benchmark"])
def test_cuda_knobs_need_device_cuda(knob):
    with pytest.raises(SystemConfigError, match="CUDA knob") as info:
        SystemConfig(**{knob: True})
    assert info.value.field == f"system.{knob}"
    assert getattr(SystemConfig(device="cuda", **{knob: True}), knob) is True


def test_fp16_needs_cuda_while_bf16_channels_last_and_compile_work_on_the_cpu():
    with pytest.raises(SystemConfigError, match="fp16 autocast needs device: cuda") as info:
        SystemConfig(precision="fp16")
    assert info.value.field == "system.precision"
    config = SystemConfig(precision="bf16", channels_last=True, compile=True)
    assert config.label() == "cores=1 interop=1 workers=0 bf16 channels_last compiled"
    assert config.one_time_knobs() == ("compile",)
    assert config.as_metrics()["sys_compile"] == 1.0


def test_cpu_bf16_is_refused_on_a_processor_without_native_bf16(tmp_path, monkeypatch):
    config = SystemConfig(precision="bf16")
    with pytest.raises(SystemConfigError, match="avx512_bf16 or amx_bf16") as info:
        config.check_machine(MachineInfo(cores=2, cpu_flags=frozenset({"avx2", "avx512f"})),
                             where="system.default")
    assert info.value.field == "system.default.precision"
    config.check_machine(MachineInfo(cores=2, cpu_flags=frozenset({"amx_bf16"})))
    # The flags come from /proc/cpuinfo, or the file $PIPETUNE_CPUINFO names.
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n\nprocessor\t: 1\n")
    monkeypatch.setenv("PIPETUNE_CPUINFO", str(fake))
    assert MachineInfo.detect().cpu_flags == {"fpu", "sse2", "avx2"}
    assert not MachineInfo.detect().cpu_bf16


def test_cuda_rejected_on_a_machine_without_a_gpu():
    config = SystemConfig(device="cuda", precision="bf16", tf32=True)
    with pytest.raises(SystemConfigError, match="no CUDA device") as info:
        config.check_machine(MachineInfo(cores=2))
    assert info.value.field == "system.device"
    config.check_machine(MachineInfo(cores=2, cuda_devices=1))


def test_more_cores_than_the_machine_has_are_rejected():
    with pytest.raises(SystemConfigError, match="4 cores requested but this machine has 2") as info:
        SystemConfig(cores=4).check_machine(MachineInfo(cores=2))
    assert info.value.field == "system.cores"
    with pytest.raises(SystemConfigError) as info:
        SystemConfig(cores=4).check_machine(MachineInfo(cores=2), where="system.default")
    assert info.value.field == "system.default.cores"
    SystemConfig(cores=2).check_machine(MachineInfo(cores=2))


def test_detected_machine_matches_the_process_affinity():
    machine = MachineInfo.detect()
    assert machine.cores == len(os.sched_getaffinity(0)) >= 1
    assert machine.cuda_devices >= 0


def test_dict_round_trip_and_unknown_knob():
    config = SystemConfig(cores=2, interop_threads=2, dataloader_workers=1)
    assert tuple(config.to_dict()) == KNOBS
    assert SystemConfig.from_dict(config.to_dict()) == config
    with pytest.raises(SystemConfigError, match="unknown knob") as info:
        SystemConfig.from_dict({"cores": 1, "threads": 2})
    assert info.value.field == "system.threads"
    with pytest.raises(SystemConfigError):
        config.replace(cores=0)  # replace checks too


def test_label_and_metrics():
    assert SystemConfig(cores=2).replace(dataloader_workers=1).label() == (
        "cores=2 interop=1 workers=1"
    )
    gpu = SystemConfig(device="cuda", precision="bf16", tf32=True)
    assert gpu.label() == "cores=1 interop=1 workers=0 cuda bf16 tf32"
    metrics = gpu.as_metrics()
    assert metrics["sys_cuda"] == 1.0 and metrics["sys_precision_bits"] == 16.0
    assert all(isinstance(v, float) for v in SystemConfig().as_metrics().values())


def test_values_pickle_round_trip():
    for value in (
        SystemConfig(cores=2, dataloader_workers=1),
        SystemConfig(device="cuda", precision="fp16", channels_last=True),
        MachineInfo(cores=3, cuda_devices=1),
    ):
        clone = pickle.loads(pickle.dumps(value))
        assert clone == value and hash(clone) == hash(value)


def test_applied_config_sets_torch_threads_and_restores_them():
    import torch

    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    with applied_system_config(SystemConfig(cores=target)) as applied:
        assert torch.get_num_threads() == target
        assert applied.config.cores == target
    assert torch.get_num_threads() == before

    with pytest.raises(RuntimeError, match="boom"):
        with applied_system_config(SystemConfig(cores=target)):
            raise RuntimeError("boom")
    assert torch.get_num_threads() == before


def test_applied_cuda_flags_are_restored():
    import torch

    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark)
    config = SystemConfig(device="cuda", tf32=not saved[0], cudnn_benchmark=not saved[1])
    with applied_system_config(config):
        assert torch.backends.cuda.matmul.allow_tf32 is (not saved[0])
        assert torch.backends.cudnn.benchmark is (not saved[1])
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark) == saved


def test_autocast_is_off_on_the_cpu_and_in_fp32():
    import contextlib

    assert isinstance(autocast_for(SystemConfig()), contextlib.nullcontext)
    assert isinstance(autocast_for(SystemConfig(device="cuda")), contextlib.nullcontext)


def test_autocast_uses_the_configs_precision_on_a_gpu():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with autocast_for(SystemConfig(device="cuda", precision="bf16")):
        out = torch.ones(4, 4, device="cuda") @ torch.ones(4, 4, device="cuda")
    assert out.dtype == torch.bfloat16


def test_applied_context_derives_what_a_step_needs_and_a_workload_trains_under_it():
    import contextlib

    import torch

    from pipetune.errors import WorkloadError
    from pipetune.system.apply import AppliedConfig, applied_context
    from pipetune.workloads.lenet import LeNet5Workload

    ctx = applied_context(SystemConfig(dataloader_workers=2))
    assert isinstance(ctx, AppliedConfig) and ctx.notes == [] and ctx.actual == {}
    assert applied_context(ctx) is ctx
    options = ctx.loader_options()
    assert options["num_workers"] == 2 and options["persistent_workers"] is False
    assert options["pin_memory"] is False
    assert ctx.memory_format == torch.contiguous_format
    assert ctx.device == torch.device("cpu")
    assert isinstance(ctx.autocast(), contextlib.nullcontext)
    assert ctx.grad_scaler({}) is None
    assert "multiprocessing_context" not in applied_context(SystemConfig()).loader_options()
    # CUDA knobs are derived without touching a GPU; only the device needs one.
    gpu = applied_context(SystemConfig(device="cuda", channels_last=True, precision="bf16"))
    assert gpu.memory_format == torch.channels_last
    assert gpu.loader_options()["pin_memory"] is True
    fp32 = applied_context(SystemConfig(device="cuda"))
    assert isinstance(fp32.autocast(), contextlib.nullcontext)
    if torch.cuda.is_available():
        assert gpu.device == torch.device("cuda")
        assert isinstance(gpu.autocast(), torch.autocast)
    else:
        with pytest.raises(WorkloadError, match="torch sees no CUDA device"):
            _ = gpu.device

    config = SystemConfig()
    workload = LeNet5Workload(train_samples=64, val_samples=32)
    workload.setup({"lr": 0.02, "batch_size": 16}, seed=0)
    with applied_system_config(config) as applied:
        assert applied.config is config
        stats = workload.train_epoch(applied)
        metrics = workload.evaluate(applied)
    assert stats.samples == 64 and stats.steps == 4
    assert set(metrics) >= {"accuracy", "val_loss"}
    again = LeNet5Workload(train_samples=64, val_samples=32)
    again.setup({"lr": 0.02, "batch_size": 16}, seed=0)
    with applied_system_config(config):
        assert again.train_epoch(config).loss == stats.loss  # a plain config: same epoch
