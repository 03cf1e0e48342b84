"""Compile the CUDA kernels of `csrc/` with NVRTC (from torch's CUDA wheel) at first use: no
CUDA toolkit, no host compiler. One compile per kernel instance (a template's name expression
and the `__device__` variables its launcher reads) into a cubin for the GPU, or PTX for an
older architecture (`TINYSERVE_CUDA_ARCH`), cached in TINYSERVE_CACHE_DIR."""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch  # noqa: F401 - a CUDA build of torch loads its NVRTC first

from tinyserve import envs
from tinyserve.log import get_logger

log = get_logger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"


class KernelBuildError(RuntimeError):
    """NVRTC is missing or a kernel did not compile."""


@dataclass(frozen=True)
class Built:
    """A compiled kernel instance: the image (cubin, or PTX text with `is_ptx`) and the
    mangled names of the requested name expressions."""

    image: bytes
    is_ptx: bool
    lowered: dict[str, str]
    log: str


def _candidates() -> list[str]:
    """Where libnvrtc may be: the names the loader resolves (torch preloads its own), then the
    nvidia-* wheels in site-packages, then a toolkit under CUDA_HOME."""
    found = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]  # newest first
    roots = [p for p in sys.path if p.endswith("site-packages")]
    for root in roots:
        found += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so*")),
                        reverse=True)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")), reverse=True)
    return [f for f in found if "alt" not in os.path.basename(f) and "builtins" not in f]


@functools.cache
def nvrtc() -> ctypes.CDLL:
    """The NVRTC library; KernelBuildError (one line: what is missing, how to get it) when
    there is none."""
    for name in _candidates():
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    raise KernelBuildError("the CUDA kernels need NVRTC (libnvrtc.so.12 or .13) and none was "
                           "found: install NVIDIA's NVRTC wheel matching torch's CUDA (pip "
                           "install nvidia-cuda-nvrtc-cu12 for CUDA 12 builds of torch, "
                           "nvidia-cuda-nvrtc for CUDA 13)")


def nvrtc_version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


@functools.cache
def supported_archs() -> tuple[int, ...]:
    """The architectures this NVRTC compiles for (e.g. 75, 80, ..., 120)."""
    lib = nvrtc()
    n = ctypes.c_int()
    _check(lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)), "nvrtcGetNumSupportedArchs")
    archs = (ctypes.c_int * n.value)()
    _check(lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
    return tuple(archs)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise KernelBuildError(f"{what} failed: {nvrtc().nvrtcGetErrorString(rc).decode()}")


@functools.cache
def _sources_digest() -> str:
    """A hash of every file in csrc/: a change to any header rebuilds every kernel."""
    h = hashlib.sha256()
    for f in sorted(CSRC.iterdir()):
        if f.suffix in (".cu", ".cuh"):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def build(source: str, names: tuple[str, ...], arch: int, *, ptx: bool = False,
          options: tuple[str, ...] = ()) -> Built:
    """Compile csrc/`source` for `arch` (e.g. 86) instantiating the name expressions `names`
    (kernels, and `&`-prefixed `__device__` variables). Cached on disk; KernelBuildError with
    NVRTC's log when the source does not compile."""
    target = f"--gpu-architecture={'compute' if ptx else 'sm'}_{arch}"
    opts = (target, f"-I{CSRC}", "-std=c++17", *options)
    key = json.dumps([_sources_digest(), source, names, opts, nvrtc_version()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    out_dir = envs.CACHE_DIR.get() / "kernels"
    image_path = out_dir / f"{Path(source).stem}_{digest}.{'ptx' if ptx else 'cubin'}"
    names_path = image_path.with_suffix(".json")
    if image_path.exists() and names_path.exists():
        meta = json.loads(names_path.read_text())
        return Built(image_path.read_bytes(), ptx, meta["lowered"], meta["log"])
    built = _compile(source, names, opts, ptx)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = json.dumps({"lowered": built.lowered, "log": built.log}).encode()
    for path, data in ((image_path, built.image), (names_path, meta)):
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return built


def _compile(source: str, names: tuple[str, ...], opts: tuple[str, ...], ptx: bool) -> Built:
    lib = nvrtc()
    text = (CSRC / source).read_bytes()
    prog = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(prog), text, source.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        for name in names:
            _check(lib.nvrtcAddNameExpression(prog, name.encode()),
                   f"nvrtcAddNameExpression({name})")
        c_opts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        log.debug("compiling %s %s (%s)", source, ", ".join(names), opts[0].split("=")[1])
        rc = lib.nvrtcCompileProgram(prog, len(opts), c_opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        text_log = buf.value.decode(errors="replace")
        if rc != 0:
            raise KernelBuildError(f"NVRTC could not compile {source} ({', '.join(names)}):\n"
                                   f"{text_log[-4000:]}")
        lowered = {}
        for name in names:
            low = ctypes.c_char_p()
            _check(lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(low)),
                   f"nvrtcGetLoweredName({name})")
            lowered[name] = low.value.decode()
        get_size, get = ((lib.nvrtcGetPTXSize, lib.nvrtcGetPTX) if ptx
                         else (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN))
        _check(get_size(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        image = ctypes.create_string_buffer(size.value)
        _check(get(prog, image), "nvrtcGetCUBIN")
        return Built(image.raw, ptx, lowered, text_log)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
