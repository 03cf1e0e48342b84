"""Build the plain-CUDA kernels of `csrc/` at first use and load them with ctypes.

A library is a set of .cu sources (no torch headers, extern "C" launchers that return 0 or an
error code) compiled by nvcc for the running GPU's architecture into a shared library cached
in TINYSERVE_CACHE_DIR, keyed by a hash of its sources and headers. Launchers pass torch's
current stream, so the kernels can be captured in CUDA graphs. Nothing here runs at import.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from tinyserve import envs
from tinyserve.log import get_logger

log = get_logger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"


def nvcc() -> str:
    """The nvcc on PATH or under torch's CUDA_HOME; RuntimeError when there is none."""
    found = shutil.which("nvcc")
    if found:
        return found
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME and Path(CUDA_HOME, "bin", "nvcc").exists():
        return str(Path(CUDA_HOME, "bin", "nvcc"))
    raise RuntimeError("the CUDA kernels need nvcc (CUDA toolkit) to build on first use")


@functools.cache
def library(name: str, sources: tuple[str, ...], headers: tuple[str, ...],
            signatures: tuple[tuple[str, tuple], ...], major: int, minor: int) -> ctypes.CDLL:
    """csrc/`sources` built for sm_{major}{minor} as lib`name` (cached by the hash of the
    sources and `headers`), loaded, each (function, ctypes argtypes) of `signatures` typed
    to return int."""
    files = [CSRC / s for s in (*sources, *headers)]
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]
    out_dir = envs.CACHE_DIR.get() / "kernels"
    out_dir.mkdir(parents=True, exist_ok=True)
    lib_path = out_dir / f"lib{name}_sm{major}{minor}_{digest}.so"
    if not lib_path.exists():
        tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
        cmd = [nvcc(), "-std=c++17", "-O3", f"-arch=sm_{major}{minor}", "-shared",
               "-Xcompiler", "-fPIC", "-I", str(CSRC), "-o", str(tmp),
               *[str(CSRC / s) for s in sources]]
        log.info("building %s for sm_%d%d", name, major, minor)
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed building {name}:\n{res.stderr[-4000:]}")
        os.replace(tmp, lib_path)
    lib = ctypes.CDLL(str(lib_path))
    for fn_name, args in signatures:
        fn = getattr(lib, fn_name)
        fn.argtypes = list(args)
        fn.restype = ctypes.c_int
    return lib
