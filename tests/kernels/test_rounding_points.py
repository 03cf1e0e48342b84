"""The kernels whose contract is torch's rounding points (`kernels/norm.py`, `kernels/glue.py`)
keep them when compiled for sm_90 with their launch options (`launch.ROUNDING_AS_TORCH`): no
bf16 FMA in the PTX. With Triton's default floating-point fusion dt(dt(a * b) + c) becomes one
`fma.rn.bf16` (the inner rounding gone): on the H200 3-15 % of the RMSNorm+RoPE outputs then
differed from torch by a rounding step. Built ahead of time (no GPU needed); under the Triton
interpreter the check runs in a child process with the compiler."""

from __future__ import annotations

import pytest

from tests.kernels.sm90_build import compile_sm90, rerun_without_interpreter
from tinyserve.kernels.launch import ROUNDING_AS_TORCH

pytest.importorskip("triton")


def _kernels() -> dict:
    from tinyserve.kernels import glue, norm

    return {  # name: (jit function, constexprs)
        "rms_norm": (norm.rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK_D=256)),
        "gated_rms_norm": (norm.gated_rms_norm_kernel, dict(ROUND_WH=True, BLOCK_D=128)),
        "rms_norm_rope": (norm.rms_norm_rope_kernel, dict(BLOCK_D=256)),
        "silu_mul": (glue.silu_mul_kernel, dict(BLOCK_F=512)),
        "gated_add": (glue.gated_add_kernel, dict(BLOCK_H=1024)),
        "sigmoid_mul": (glue.sigmoid_mul_kernel, dict(BLOCK_D=256)),
    }


def _ptx(name: str, **options) -> str:
    fn, consts = _kernels()[name]
    sig = {a: "constexpr" if a in consts else "*bf16" if a.endswith("_ptr")
           else "fp32" if a == "eps" else "i32" for a in fn.arg_names}
    return compile_sm90(fn, sig, consts, num_warps=4, **options).asm["ptx"]


def test_rounding_points_kept_for_sm90() -> None:
    if rerun_without_interpreter(__file__, "kept_for_sm90", timeout=300, marker="not slow"):
        return
    for name in _kernels():
        ptx = _ptx(name, **ROUNDING_AS_TORCH)
        assert "fma.rn.bf16" not in ptx and "cvt.rn.bf16" in ptx, name
    # what the launch options prevent: these two fuse a rounded product into the next add
    for name in ("rms_norm_rope", "gated_add"):
        assert "fma.rn.bf16" in _ptx(name), name
