"""Load and launch the kernels `cuda_build` compiles through the CUDA driver API (libcuda):
no CUDA runtime library, no host compiler.

`backend(device).kernel(source, name)` compiles (cached), loads and returns a `Kernel` whose
`launch` enqueues on torch's current stream (CUDA graphs capture it). `use_backend` installs
the tests' CPU emulation. `TINYSERVE_CUDA_ARCH=sm_80` builds PTX for an older architecture and
takes its paths (no dependent launches below sm_90, no E4M3 cvt below sm_89)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from tinyserve import envs
from tinyserve.kernels import cuda_build, launch
from tinyserve.log import get_logger

log = get_logger(__name__)

_INVALID_CONTEXT = 201
# device attributes
_SM_COUNT, _SMEM_PER_SM, _RESERVED_SMEM = 16, 81, 111
# function attributes
SHARED_SIZE_BYTES, MAX_DYNAMIC_SHARED = 1, 8


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_int), ("value_pad", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PDL = _LaunchAttribute(id=6, value=1)  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION

# Kernel arguments: ctypes values of the kernel's parameter types.
I, I64, F, P = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    """A tensor's data pointer as a kernel argument (None: a null pointer)."""
    return P(t.data_ptr() if t is not None else None)


class Kernel(Protocol):
    """One compiled kernel instance, ready to launch."""

    def launch(self, grid: tuple[int, ...], block: int, args: tuple[Any, ...], *,
               smem: int = 0, stream: int = 0, pdl: bool = False) -> None:
        """Enqueue the kernel: `args` are ctypes values in the order and types of its
        parameters; `pdl` makes it a programmatic dependent launch (ignored below sm_90)."""

    def global_int(self, name: str) -> int:
        """The value of an `int` `__device__` variable compiled with the kernel."""

    def attribute(self, attr: int) -> int:
        """A function attribute (SHARED_SIZE_BYTES, ...)."""

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        """Allow launches with up to `nbytes` of dynamic shared memory (above 48 KB)."""

    def occupancy(self, block: int, smem: int) -> int:
        """Resident CTAs per SM for `block` threads and `smem` dynamic shared memory."""


class Backend(Protocol):
    arch: int  # the architecture the kernels are built for (86 for sm_86)
    num_sms: int
    smem_per_sm: int
    reserved_smem_per_block: int

    def kernel(self, source: str, name: str, globals_: tuple[str, ...] = ()) -> Kernel: ...

    def stream(self) -> int: ...


@functools.cache
def driver() -> ctypes.CDLL:
    """libcuda; KernelBuildError when the NVIDIA driver is not installed."""
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuLaunchKernel.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_void_p]
        if hasattr(lib, "cuLaunchKernelEx"):  # (CUDA 12+ drivers)
            lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                             ctypes.c_void_p, ctypes.c_void_p]
        return lib
    raise cuda_build.KernelBuildError("the CUDA kernels need the NVIDIA driver (libcuda.so.1)")


def check(rc: int, what: str) -> None:
    """RuntimeError naming `what` and the driver's error unless `rc` (a CUresult) is 0."""
    if rc != 0:
        msg = ctypes.c_char_p()
        driver().cuGetErrorString(rc, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: CUDA error {rc} "
                           f"({(msg.value or b'unknown').decode()})")


def _make_current(index: int) -> None:
    """Make the device's primary context (torch's) current on this thread."""
    lib = driver()
    ctx = ctypes.c_void_p()
    check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if ctx.value:
        return
    torch.cuda.init()
    dev = ctypes.c_int()
    check(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
    check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class CudaKernel:
    """A kernel loaded into the device's primary context (`Kernel`)."""

    def __init__(self, index: int, built: cuda_build.Built, name: str) -> None:
        lib = driver()
        self._index = index
        _make_current(index)
        self._module = ctypes.c_void_p()
        image = built.image + (b"\0" if built.is_ptx else b"")
        check(lib.cuModuleLoadData(ctypes.byref(self._module), image),
               f"loading {name} (cuModuleLoadData)")
        self._func = ctypes.c_void_p()
        check(lib.cuModuleGetFunction(ctypes.byref(self._func), self._module,
                                       built.lowered[name].encode()),
               f"cuModuleGetFunction({name})")
        self._lowered = built.lowered
        self.name = name
        self._has_ex = hasattr(lib, "cuLaunchKernelEx")
        self._max_smem = -1

    def launch(self, grid: tuple[int, ...], block: int, args: tuple[Any, ...], *,
               smem: int = 0, stream: int = 0, pdl: bool = False) -> None:
        g = (*grid, 1, 1)[:3]
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        lib = driver()
        if pdl and self._has_ex:
            cfg = _LaunchConfig((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(block, 1, 1), smem,
                                stream, ctypes.pointer(_PDL), 1)
            call = functools.partial(lib.cuLaunchKernelEx, ctypes.byref(cfg), self._func,
                                     params, None)
        else:
            call = functools.partial(lib.cuLaunchKernel, self._func, *g, block, 1, 1, smem,
                                     stream, params, None)
        rc = call()
        if rc == _INVALID_CONTEXT:  # a thread that never used CUDA before
            _make_current(self._index)
            rc = call()
        check(rc, f"launching {self.name}")

    def global_int(self, name: str) -> int:
        lib = driver()
        ptr, size = ctypes.c_uint64(), ctypes.c_size_t()
        check(lib.cuModuleGetGlobal_v2(ctypes.byref(ptr), ctypes.byref(size), self._module,
                                        self._lowered[name].encode()), f"cuModuleGetGlobal({name})")
        value = ctypes.c_int()
        check(lib.cuMemcpyDtoH_v2(ctypes.byref(value), ptr, ctypes.c_size_t(4)), "cuMemcpyDtoH")
        return value.value

    def attribute(self, attr: int) -> int:
        value = ctypes.c_int()
        check(driver().cuFuncGetAttribute(ctypes.byref(value), attr, self._func),
               "cuFuncGetAttribute")
        return value.value

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        if nbytes == self._max_smem:  # (a launcher sets it before every launch)
            return
        check(driver().cuFuncSetAttribute(self._func, MAX_DYNAMIC_SHARED, nbytes),
              f"allowing {nbytes} bytes of dynamic shared memory for {self.name}")
        self._max_smem = nbytes

    def occupancy(self, block: int, smem: int) -> int:
        n = ctypes.c_int()
        check(driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(n), self._func, block, ctypes.c_size_t(smem)), "cuOccupancy")
        return n.value


class CudaBackend:
    """The kernels of one CUDA device (`Backend`)."""

    def __init__(self, index: int) -> None:
        self.index = index
        major, minor = torch.cuda.get_device_capability(index)
        native = 10 * major + minor
        archs = cuda_build.supported_archs()
        if envs.CUDA_ARCH.get().strip():  # PTX for an older architecture
            self.arch, self.ptx = launch.target_arch(torch.device("cuda", index)), True
            if self.arch > native:
                raise ValueError(f"TINYSERVE_CUDA_ARCH=sm_{self.arch} is newer than this GPU "
                                 f"(sm_{native})")
        elif native in archs:  # a cubin
            self.arch, self.ptx = native, False
        else:  # a GPU newer than this NVRTC: the newest PTX it makes, compiled by the driver
            self.arch, self.ptx = max(a for a in archs if a <= native), True
        if self.arch not in archs:
            raise cuda_build.KernelBuildError(
                f"NVRTC {cuda_build.nvrtc_version()} cannot build for sm_{self.arch}")
        _make_current(index)
        self.num_sms = self._attr(_SM_COUNT)
        self.smem_per_sm = self._attr(_SMEM_PER_SM)
        self.reserved_smem_per_block = self._attr(_RESERVED_SMEM)
        self._kernels: dict[tuple[str, str], CudaKernel] = {}
        self._lock = threading.Lock()
        major, minor = cuda_build.nvrtc_version()
        log.info("CUDA kernels for %s: compiled by NVRTC %d.%d at first use, cached in %s",
                 self.target, major, minor, envs.CACHE_DIR.get() / "kernels")

    def _attr(self, attr: int) -> int:
        v = ctypes.c_int()
        check(driver().cuDeviceGetAttribute(ctypes.byref(v), attr, self.index),
              "cuDeviceGetAttribute")
        return v.value

    @property
    def target(self) -> str:
        return f"{'compute' if self.ptx else 'sm'}_{self.arch}"

    def kernel(self, source: str, name: str, globals_: tuple[str, ...] = ()) -> CudaKernel:
        key = (source, name)
        k = self._kernels.get(key)
        if k is None:
            with self._lock:
                k = self._kernels.get(key)
                if k is None:
                    built = cuda_build.build(source, (name, *globals_), self.arch, ptx=self.ptx)
                    k = self._kernels[key] = CudaKernel(self.index, built, name)
        return k

    def stream(self) -> int:
        return torch.cuda.current_stream(self.index).cuda_stream


_override: Backend | None = None
_cuda_backend = functools.cache(CudaBackend)  # one per device index


def backend(device: torch.device) -> Backend:
    """The kernels' backend for `device` (a CUDA device; any device while `use_backend` has
    installed one). ValueError for a device with neither."""
    if _override is not None:
        return _override
    if device.type != "cuda":
        raise ValueError(f"the CUDA kernels run on a CUDA device, got {device}")
    return _cuda_backend(device.index if device.index is not None else
                         torch.cuda.current_device())


def num_sms(device: torch.device) -> int:
    """SMs of the installed backend or of a CUDA `device`; 4 elsewhere (split planning)."""
    if _override is not None:
        return _override.num_sms
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@contextlib.contextmanager
def use_backend(b: Backend) -> Iterator[Backend]:
    """Run every launcher on `b` while the block runs (the tests' CPU emulation)."""
    global _override
    prev, _override = _override, b
    try:
        yield b
    finally:
        _override = prev

