"""What the process holds on the GPU, as the driver counts it (NVML faked here): the per-process
figure, the device less its baseline, the torch fallback; the start-up measurement and the
budget's refusal with numbers (torch.cuda faked: the arithmetic runs on the CPU)."""

from __future__ import annotations

import contextlib
import os
import sys
import types

import pytest
import torch

from tinyserve.engine import device_memory as dm
from tinyserve.engine.config import EngineConfig

MiB = 1 << 20


class FakeNVML(types.ModuleType):
    def __init__(self, used: int, procs: list | None = None) -> None:
        super().__init__("pynvml")
        self.used, self.procs = used, procs or []

    def nvmlInit(self) -> None:  # noqa: N802
        pass

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:  # noqa: N802
        return f"gpu{index}"

    def nvmlDeviceGetMemoryInfo(self, handle: str):  # noqa: N802
        return types.SimpleNamespace(used=self.used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list:  # noqa: N802
        return self.procs


def _proc(pid: int, used: int | None):
    return types.SimpleNamespace(pid=pid, usedGpuMemory=used)


@pytest.fixture(autouse=True)
def fresh_probes():
    dm.probe_for.cache_clear()
    yield
    dm.probe_for.cache_clear()


def test_probe_prefers_the_per_process_figure(monkeypatch) -> None:
    nvml = FakeNVML(used=3000 * MiB)  # other processes: 3000 MiB before ours
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    probe = dm.DeviceMemoryProbe(0)
    nvml.used += 700 * MiB
    nvml.procs = [_proc(1, 3000 * MiB), _proc(os.getpid(), 690 * MiB)]
    assert probe.process_used() == 690 * MiB and probe.source == "NVML, this process"
    nvml.procs = [_proc(1, 3000 * MiB)]  # not listed (another PID namespace)
    assert probe.process_used() == 700 * MiB and probe.source == "NVML, device less baseline"
    nvml.procs = [_proc(os.getpid(), None)]  # listed without a figure
    assert probe.process_used() == 700 * MiB


def test_probe_without_nvml_counts_the_device(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=None: (5000 * MiB, 8192 * MiB))
    probe = dm.DeviceMemoryProbe(0)
    assert probe.process_used() == 3192 * MiB and probe.source == "device-wide, no NVML"


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda as a GPU of 8 GiB with 5 GiB free once this process took 520 MiB."""
    nvml = FakeNVML(used=2000 * MiB, procs=[_proc(os.getpid(), 520 * MiB)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    cuda = torch.cuda
    real_ones = torch.ones
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device", lambda i: contextlib.nullcontext())
    monkeypatch.setattr(torch, "ones", lambda *s, device=None, dtype=None: real_ones(
        *s, dtype=dtype))
    monkeypatch.setattr(cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(cuda, "memory_reserved", lambda i=None: 2 * MiB)
    monkeypatch.setattr(cuda, "mem_get_info", lambda i=None: (5 * 1024 * MiB, 8 * 1024 * MiB))
    monkeypatch.setattr(cuda, "get_device_name", lambda i=None: "Fake GPU")
    return nvml


def test_start_up_is_measured_and_the_budget_checked(fake_gpu) -> None:
    dev = dm.measure_device(EngineConfig(model="m", device="cuda", gpu_memory="4GiB"))
    # 520 MiB held, 2 MiB of it torch's: 518 MiB outside the allocator, rounded up to 8 MiB
    assert dev.startup == 520 * MiB and dev.name == "Fake GPU"
    assert dev.budget == 4096 * MiB and dev.budget_source == "--gpu-memory 4GiB (4,096 MiB)"
    assert dev.startup_source == "measured at start-up (NVML, this process)"
    free = dm.measure_device(EngineConfig(model="m", device="cuda"))
    assert free.budget == 5 * 1024 * MiB + 520 * MiB  # free + what this process holds
    assert free.budget_source == "free device memory (5,640 MiB)"
    with pytest.raises(ValueError) as err:
        dm.measure_device(EngineConfig(model="m", device="cuda", gpu_memory="6GiB"))
    assert str(err.value) == ("--gpu-memory 6GiB asks for 6,144 MiB but Fake GPU has 5,640 MiB "
                              "for this process (8,192 MiB in all, the rest used by others)")


def test_which_device_is_planned(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dm.device_memory(EngineConfig(model="m")).device == "cpu"
    assert dm.device_memory(EngineConfig(model="m", device="cpu", gpu_memory="6GiB")).device \
        == "cpu"
    ref = dm.device_memory(EngineConfig(model="m", gpu_memory="6GiB"), measure=False)
    assert ref.is_cuda and ref.startup == dm.H200_STARTUP and "no CUDA device" in \
        ref.startup_source
    with pytest.raises(ValueError, match="CUDA is not available"):
        dm.device_memory(EngineConfig(model="m", device="cuda", gpu_memory="6GiB"))
    # a plan for the CPU's own use: no budget wanted
    assert dm.device_memory(EngineConfig(model="m"), measure=False).device == "cpu"
