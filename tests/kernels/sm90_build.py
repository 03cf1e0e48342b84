"""Ahead-of-time sm_90 builds of Triton kernels without a GPU, for the kernels' build tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def ptxas_entries(source: str, names: list[str], arch: int = 90) -> list[str]:
    """ptxas's report of each kernel of `names` (csrc/`source`) built by NVRTC for `arch` (no
    GPU needed); skips the test without NVRTC."""
    import pytest

    from tinyserve.kernels import cuda_build

    try:
        cuda_build.nvrtc()
    except cuda_build.KernelBuildError as exc:
        pytest.skip(str(exc))
    entries = []
    for name in names:
        built = cuda_build.build(source, (name,), arch, options=("--ptxas-options=-v",))
        entries += built.log.split("Compiling entry function")[1:]
    return entries


def rerun_without_interpreter(test_file: str, keyword: str, *, timeout: int = 600,
                              tail: int = 1500, marker: str = "slow") -> bool:
    """Under TRITON_INTERPRET=1 nothing compiles: run the tests of `test_file` matching
    `keyword` and `marker` in a child process without the interpreter and assert they pass.
    True when it did (the caller is done), False when this process can compile itself."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-m", "pytest", test_file, "-q", "-s", "-m", marker,
                        "-k", keyword, "-p", "no:cacheprovider"],
                       env=env, capture_output=True, text=True, timeout=timeout)
    print(r.stdout[-tail:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    return True


def compile_sm90(fn: Any, signature: dict, constexprs: dict, attrs: dict | None = None,
                 **options: Any) -> Any:
    """`triton.compile` of the jit function `fn` for sm_90 (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(fn, signature, constexprs, attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def resource_usage(kernel: Any, name: str) -> str | None:
    """`cuobjdump -res-usage` of a compiled kernel's cubin (None when Triton ships no
    cuobjdump)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.TemporaryDirectory() as tmp:  # one per call: test processes run side by side
        path = Path(tmp) / f"{name}.cubin"
        path.write_bytes(kernel.asm["cubin"])
        return subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True,
                              text=True).stdout


def sass_instructions(kernel: Any) -> list[str]:
    """A compiled kernel's SASS instructions in order (`nvdisasm` shipped with Triton), [] when
    Triton ships none."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not tool.exists():
        return []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{kernel.name}.cubin"
        path.write_bytes(kernel.asm["cubin"])
        out = subprocess.run([str(tool), "-c", str(path)], capture_output=True, text=True).stdout
    return [line.split("*/", 1)[1].strip() for line in out.splitlines()
            if line.strip().startswith("/*") and ";" in line]


def usage_field(usage: str, field: str) -> int | None:
    """A number of a `resource_usage` report ("REG", "STACK", "SHARED", ...), None if absent."""
    m = re.search(rf"{field}:(\d+)", usage)
    return int(m.group(1)) if m else None
