"""The device side of the memory plan: the budget (`--gpu-memory` bounds the whole process as
the driver counts it) and what the process holds outside torch's allocator: the CUDA context
and libraries (measured at start-up), later growth and host-memory mappings (measured by
bench/memory_budget.py). Usage comes from NVML (per process, else less a baseline), else the
device-wide figure, which counts other processes too.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

from tinyserve.engine.config import EngineConfig, describe_size
from tinyserve.engine.memory_plan import GiB, MiB
from tinyserve.log import get_logger

log = get_logger(__name__)

# Measured on the reference GPU, an H200, by bench/memory_budget.py (docs/RESULTS.md, "The
# whole process inside --gpu-memory"); the start-up figure only where no GPU is measured.
H200_STARTUP = 680 * MiB  # context + cuBLAS/cuBLASLt after a bf16 and an fp32 matmul
LATE_GROWTH = 192 * MiB  # kernel modules, local-memory growth, graph executables
MAPPING_PER_GIB = 0  # device memory per GiB of registered host memory
_ROUND = 8 * MiB  # measured figures are rounded up to this, so that plan and run agree


def _round_up(n: int) -> int:
    return -(-max(n, 0) // _ROUND) * _ROUND


@dataclass(frozen=True)
class DeviceMemory:
    """`budget`: bytes for the whole process (None on the CPU); `startup`: context and
    libraries outside torch's allocator; `*_source`: how each is known."""

    device: str
    name: str = ""
    budget: int | None = None
    budget_source: str = ""
    startup: int = 0
    startup_source: str = ""

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def outside_allocator(self, host_mapped_bytes: int) -> tuple[tuple[str, int, str], ...]:
        """(item, bytes, how it is known) of the device memory outside torch's allocator,
        with `host_mapped_bytes` of host memory registered for the device."""
        if not self.is_cuda:
            return ()
        mapped = -(-host_mapped_bytes * MAPPING_PER_GIB // GiB)
        return (("CUDA context, libraries", self.startup, self.startup_source),
                ("kernels, local memory, graphs", LATE_GROWTH, "H200 measurement"),
                ("host memory mappings", _round_up(mapped), "H200 measurement"))


def reference_device(config: EngineConfig) -> DeviceMemory:
    """A GPU that is not here: the budget must be given; `H200_STARTUP` stands in."""
    budget = config.gpu_memory_bytes
    if budget is None:
        raise ValueError("no CUDA device here: give the budget with --gpu-memory (e.g. 6GiB), "
                         "or plan for the CPU with --device cpu")
    return DeviceMemory(device=config.device or "cuda", budget=budget,
                        budget_source=_budget_flag(config),
                        startup=H200_STARTUP,
                        startup_source="H200 measurement (no CUDA device here)")


def _budget_flag(config: EngineConfig) -> str:
    return f"--gpu-memory {describe_size(config.gpu_memory)}"  # type: ignore[arg-type]


class DeviceMemoryProbe:
    """This process's device memory on one GPU as the driver counts it. Made before CUDA
    starts (for the NVML baseline); `process_used()` is thread-safe."""

    def __init__(self, index: int = 0) -> None:
        import torch

        self.index = index
        self._nvml: Any = None
        self._handle: Any = None
        self._baseline: int | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            try:  # NVML numbers the devices without CUDA_VISIBLE_DEVICES; torch maps them
                nvml_index = torch.cuda._get_nvml_device_index(index)
            except Exception:
                nvml_index = index
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
            self._nvml = pynvml
        except Exception:  # no nvidia-ml-py, no driver: fall back to torch
            return
        if not torch.cuda.is_initialized():
            self._baseline = int(pynvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    @property
    def source(self) -> str:
        if self._process_entry() is not None:
            return "NVML, this process"
        if self._baseline is not None:
            return "NVML, device less baseline"
        return "device-wide, no NVML"

    def _process_entry(self) -> int | None:
        if self._nvml is None:
            return None
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception:
            return None
        return next((int(p.usedGpuMemory) for p in procs
                     if p.pid == os.getpid() and p.usedGpuMemory is not None), None)

    def process_used(self) -> int:
        used = self._process_entry()
        if used is not None:
            return used
        if self._baseline is not None:
            return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used) - self._baseline
        import torch

        free, total = torch.cuda.mem_get_info(self.index)
        return int(total - free)


@functools.cache
def probe_for(index: int) -> DeviceMemoryProbe:
    """The process's probe of GPU `index` (made on first use: before CUDA, when possible)."""
    return DeviceMemoryProbe(index)


def _device_index(device: str) -> int:
    return int(device.split(":")[1]) if ":" in device else 0


def measure_device(config: EngineConfig) -> DeviceMemory:
    """Start CUDA and cuBLAS on `config`'s device and measure what the process then holds
    outside torch's allocator; budget: `config.gpu_memory` or the free memory plus the process's
    own. Raises ValueError without CUDA or for a budget the device cannot give."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError("CUDA is not available here: run with --device cpu")
    device = config.device or "cuda"
    index = _device_index(device)
    probe = probe_for(index)  # before the context exists, for the NVML baseline
    with torch.cuda.device(index):
        for dtype in (torch.bfloat16, torch.float32):  # cuBLAS and cuBLASLt handles
            a = torch.ones(64, 64, device=f"cuda:{index}", dtype=dtype)
            (a @ a).sum().item()
            del a
        torch.cuda.synchronize()
        used = probe.process_used()
        startup = _round_up(used - torch.cuda.memory_reserved(index))
        free, total = torch.cuda.mem_get_info(index)
    available = free + used
    name = torch.cuda.get_device_name(index)
    budget = config.gpu_memory_bytes
    if budget is not None and budget > available:
        raise ValueError(f"--gpu-memory {config.gpu_memory} asks for {budget / MiB:,.0f} "
                         f"MiB but {name} has {available / MiB:,.0f} MiB for this process "
                         f"({total / MiB:,.0f} MiB in all, the rest used by others)")
    log.info("%s: %.0f MiB outside torch's allocator after start-up (%s)", name,
             startup / MiB, probe.source)
    if budget is None:
        budget, source = available, f"free device memory ({available / MiB:,.0f} MiB)"
    else:
        source = _budget_flag(config)
    return DeviceMemory(device=device, name=name, budget=budget, budget_source=source,
                        startup=startup,
                        startup_source=f"measured at start-up ({probe.source})")


def device_memory(config: EngineConfig, *, measure: bool = True) -> DeviceMemory:
    """The device `config` runs on: the CPU, a measured GPU, or (`measure` False, a GPU
    budget and no GPU here: `tinyserve plan`) the reference GPU."""
    import torch

    here = torch.cuda.is_available()
    device = config.device or ("cuda" if here or (not measure and config.gpu_memory is not None)
                               else "cpu")
    if device == "cpu":
        return DeviceMemory(device="cpu")
    return measure_device(config) if measure or here else reference_device(config)


def device_memory_report(plan: Any, device: str) -> tuple[str, int]:
    """After the model ran: (one line on the device memory against the plan, the bytes
    outside torch's allocator); past the plan's figure the allocator is capped lower (warned)."""
    import torch

    index = _device_index(device)
    probe = probe_for(index)
    torch.cuda.synchronize(index)
    used = probe.process_used()
    outside = used - torch.cuda.memory_reserved(index)
    planned = plan.outside_allocator_bytes
    line = (f"device memory in use: {used / MiB:,.0f} MiB of the {plan.gpu_memory / MiB:,.0f} "
            f"MiB budget ({outside / MiB:,.0f} MiB outside torch's allocator, "
            f"{planned / MiB:,.0f} MiB planned; {probe.source})")
    if outside > planned:
        cap = plan.gpu_memory - outside
        cap_allocator(cap, index)
        log.warning("the process holds %.0f MiB outside torch's allocator, %.0f MiB more than "
                    "the plan set aside: the allocator is capped at %.0f MiB", outside / MiB,
                    (outside - planned) / MiB, cap / MiB)
    return line, outside


def cap_allocator(cap: int, index: int) -> None:
    """Cap torch's allocator on GPU `index` at `cap` bytes (allocations past it fail loudly)."""
    import torch

    total = torch.cuda.get_device_properties(index).total_memory
    fraction = min(1.0, max(cap, 1) / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    log.info("GPU allocator capped at %.0f MiB of %.0f MiB", fraction * total / MiB,
             total / MiB)
