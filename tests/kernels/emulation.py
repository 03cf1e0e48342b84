"""The CUDA kernels of csrc/ on the CPU: a `cuda_launch.Backend` whose kernels are compiled by
g++ under the CUDA emulation in cuda_emu/emu.h (prelude.cuh includes it when no CUDA compiler
builds the sources). Installed with `cuda_launch.use_backend`, it runs the library's own
launchers on CPU tensors, so a test checks the launch arithmetic (grids, template arguments,
argument packing) together with the kernels' indexing, shuffles, shared memory and merges."""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tinyserve.kernels.cuda_build import CSRC

EMU = Path(__file__).resolve().parent / "cuda_emu"


class EmuKernel:
    """One kernel instance compiled for the CPU (`cuda_launch.Kernel`)."""

    def __init__(self, lib: ctypes.CDLL, name: str, globals_: tuple[str, ...]) -> None:
        self._lib, self.name, self._globals = lib, name, globals_
        lib.emu_launch.argtypes = [ctypes.c_uint] * 4 + [ctypes.c_size_t, ctypes.c_void_p]
        lib.emu_global.restype = ctypes.c_void_p
        self.launches = 0

    def launch(self, grid: tuple[int, ...], block: int, args: tuple[Any, ...], *,
               smem: int = 0, stream: int = 0, pdl: bool = False) -> None:
        g = (*grid, 1, 1)[:3]
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        self._lib.emu_launch(*g, block, smem, params)
        self.launches += 1

    def global_int(self, name: str) -> int:
        return ctypes.c_int.from_address(self._lib.emu_global(self._globals.index(name))).value

    def attribute(self, attr: int) -> int:
        return 0  # no static shared memory, no registers to count

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        pass

    def occupancy(self, block: int, smem: int) -> int:
        return 2  # the emulation has no SMs: every kernel "fits" twice


class EmuBackend:
    """Kernels compiled with g++ into `out` (one shared library per instance), H200-like
    device numbers (`num_sms` settable: it sets the split planning)."""

    arch = 90
    smem_per_sm = 233472
    reserved_smem_per_block = 1024

    def __init__(self, out: Path, num_sms: int = 132, defines: tuple[str, ...] = ()) -> None:
        self.out, self.num_sms, self.defines = out, num_sms, defines
        self._kernels: dict[tuple[str, str], EmuKernel] = {}

    def kernel(self, source: str, name: str, globals_: tuple[str, ...] = ()) -> EmuKernel:
        key = (source, name)
        if key not in self._kernels:
            self._kernels[key] = EmuKernel(self._build(source, name, globals_), name, globals_)
        return self._kernels[key]

    def prebuild(self, items: list[tuple[str, str, tuple[str, ...]]]) -> None:
        """Compile several (source, name, globals) at once (two at a time)."""
        todo = [i for i in items if (i[0], i[1]) not in self._kernels]
        with ThreadPoolExecutor(2) as pool:
            libs = list(pool.map(lambda i: self._build(*i), todo))
        for (source, name, globals_), lib in zip(todo, libs, strict=True):
            self._kernels[(source, name)] = EmuKernel(lib, name, globals_)

    def stream(self) -> int:
        return 0

    def _build(self, source: str, name: str, globals_: tuple[str, ...]) -> ctypes.CDLL:
        cxx = shutil.which("g++")
        if cxx is None:
            pytest.skip("no g++")
        table = ", ".join(f"(const void*){g}" for g in globals_) or "nullptr"
        shim = (f'#include "{source}"\n'
                f"extern \"C\" void emu_launch(unsigned gx, unsigned gy, unsigned gz, "
                f"unsigned block, size_t smem, void** args) {{\n"
                f"  emu::launch_packed(&{name}, dim3(gx, gy, gz), dim3(block), smem, args);\n}}\n"
                f"extern \"C\" const void* emu_global(int i) {{\n"
                f"  static const void* g[] = {{{table}}};\n  return g[i];\n}}\n")
        tag = hashlib.sha256((shim + " ".join(self.defines)).encode()).hexdigest()[:16]
        src, so = self.out / f"emu_{tag}.cpp", self.out / f"emu_{tag}.so"
        src.write_text(shim)
        res = subprocess.run([cxx, "-std=c++20", "-O1", "-ffp-contract=off", "-fPIC", "-shared",
                              "-pthread", "-w", *(f"-D{d}" for d in self.defines), f"-I{EMU}",
                              f"-I{CSRC}", "-o", str(so), str(src)],
                             capture_output=True, text=True)
        if res.returncode != 0:  # g++ is here: a source the emulation cannot build is a defect
            pytest.fail(f"the emulation does not build {name}: {res.stderr[-1500:]}")
        return ctypes.CDLL(str(so))
