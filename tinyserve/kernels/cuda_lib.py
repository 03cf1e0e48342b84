"""Build-at-first-use of the plain CUDA kernels in `csrc/` (no torch headers, extern "C").

nvcc compiles a library's sources for the running GPU's architecture into a shared library
cached in TINYSERVE_CACHE_DIR (keyed by a hash of its sources and headers), loaded with
ctypes; every launcher returns an int status and takes torch's current stream last, so the
launches can be captured in CUDA graphs. Nothing here runs at import.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from tinyserve import envs
from tinyserve.log import get_logger

log = get_logger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"


def nvcc() -> str:
    """Path of nvcc (PATH first, then torch's CUDA_HOME); RuntimeError when there is none."""
    found = shutil.which("nvcc")
    if found:
        return found
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME and Path(CUDA_HOME, "bin", "nvcc").exists():
        return str(Path(CUDA_HOME, "bin", "nvcc"))
    raise RuntimeError("tinyserve's CUDA kernels need nvcc (CUDA toolkit) to build on first use")


def build(name: str, sources: Sequence[str], headers: Sequence[str], major: int, minor: int,
          signatures: dict[str, list]) -> ctypes.CDLL:
    """Compile csrc/`sources` for sm_{major}{minor} (once per source hash) and load them with
    each function of `signatures` typed (argument ctypes, int result)."""
    files = [CSRC / s for s in (*sources, *headers)]
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]
    out_dir = envs.CACHE_DIR.get() / "kernels"
    out_dir.mkdir(parents=True, exist_ok=True)
    lib_path = out_dir / f"libtinyserve_{name}_sm{major}{minor}_{digest}.so"
    if not lib_path.exists():
        tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
        cmd = [nvcc(), "-std=c++17", "-O3", f"-arch=sm_{major}{minor}", "-shared",
               "-Xcompiler", "-fPIC", "-I", str(CSRC), "-o", str(tmp),
               *[str(CSRC / s) for s in sources]]
        log.info("building the %s kernels for sm_%d%d", name, major, minor)
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed building the {name} kernels:\n{res.stderr[-4000:]}")
        os.replace(tmp, lib_path)
    lib = ctypes.CDLL(str(lib_path))
    for fn_name, args in signatures.items():
        fn = getattr(lib, fn_name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return lib
