"""Build CUDA sources of csrc/ for the CPU under the CUDA emulation in cuda_emu/emu.h: `<<<>>>`
launches become `emu::Launch(...)(kernel, ...)` calls, the rest compiles as C++20 with g++."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tinyserve.kernels.cuda_build import CSRC

EMU = Path(__file__).resolve().parent / "cuda_emu"


def build(names: tuple[str, ...], out: Path, *, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile csrc/`names` into one shared library under `out` and load it; skips the test
    when g++ is missing, fails it when the sources do not build."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++")
    sources = []
    for name in names:
        text = re.sub(r"([A-Za-z_][\w:]*(?:<[^<>;]*>)?)\s*<<<(.*?)>>>\s*\(",
                      r"emu::Launch(\2)(\1, ", (CSRC / name).read_text(), flags=re.S)
        src = out / f"{name}.cpp"
        src.write_text(text)
        sources.append(str(src))
    so = out / f"lib{Path(names[0]).stem}_emu.so"
    res = subprocess.run([cxx, "-std=c++20", "-O1", "-ffp-contract=off", "-fPIC", "-shared",
                          "-pthread", "-w", *(f"-D{d}" for d in defines), f"-I{EMU}",
                          f"-I{CSRC}", "-o", str(so), *sources], capture_output=True, text=True)
    if res.returncode != 0:  # g++ is here: a source the emulation cannot build is a defect
        pytest.fail(f"the emulation does not build: {res.stderr[-1500:]}")
    return ctypes.CDLL(str(so))
