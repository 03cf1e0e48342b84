"""The NVFP4 and FP8 gemvs as programmatic dependent launches (`nvfp4.GEMV_PDL`,
`fp8.GEMV_PDL`; modes in `launch.PDL_MODES`, sm_90+).

Their programs may start while the previous kernel still runs, so they must read x (and the
FP8 scale) only after `griddepcontrol.wait`. On the CPU: the mode names, and the sm_90 builds
(one wait and one release with a mode, none without; "weights_first": in the SASS every
weight load is issued before the wait and every x load after it). On a GPU: x is written
by a slow reduction into a NaN-filled buffer right before each gemv (a read before the wait
would see NaN or a stale x), eagerly and in a CUDA graph, in every mode: the same bits as an
ordinary launch, and the reference.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.kernels.sm90_build import compile_sm90, rerun_without_interpreter  # noqa: E402
from tests.kernels.test_fp8 import rand_fp8  # noqa: E402
from tests.kernels.test_nvfp4 import rand_nvfp4, rel_err  # noqa: E402
from tinyserve.kernels import fp8, nvfp4  # noqa: E402
from tinyserve.kernels.launch import PDL_MODES, pdl_mode  # noqa: E402
from tinyserve.kernels.nvfp4_ref import dequantize_fp8, dequantize_nvfp4  # noqa: E402
from tinyserve.kernels.nvfp4_tiles import GemvConfig  # noqa: E402

pytest.importorskip("triton")


def test_mode_names() -> None:
    cpu = torch.device("cpu")
    assert [pdl_mode(name, cpu) for name in PDL_MODES] == [0, 0, 0]  # no dependent launches
    with pytest.raises(ValueError, match="dependent-launch mode"):
        pdl_mode("early", cpu)
    assert nvfp4.GEMV_PDL in PDL_MODES and fp8.GEMV_PDL in PDL_MODES


# --- sm_90 builds without a GPU ----------------------------------------------------------------

_TYPES = {"x_ptr": "*bf16", "w_ptr": "*i64", "s_ptr": "*u8", "out_ptr": "*bf16",
          "factor": "fp32"}
_FP8_TYPES = {"x_ptr": "*i64", "w_ptr": "*i32", "s_ptr": "*fp32", "out_ptr": "*bf16"}
_DIVISIBLE = ("x_ptr", "w_ptr", "s_ptr", "out_ptr", "N", "KB", "KW", "stride_xm")


def _sass(kernel) -> list[str]:
    """The kernel's SASS instructions in order (nvdisasm shipped with Triton), [] without it."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not tool.exists():
        return []
    path = Path(os.environ.get("TMPDIR", "/tmp")) / "dependent_launch.cubin"
    path.write_bytes(kernel.asm["cubin"])
    out = subprocess.run([str(tool), "-c", str(path)], capture_output=True, text=True).stdout
    return [line.split("*/", 1)[1].strip() for line in out.splitlines()
            if line.strip().startswith("/*") and ";" in line]


def _build(jf, types: dict, consts: dict, **options):
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in jf.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(jf.arg_names)
             if a in _DIVISIBLE}
    return compile_sm90(jf, sig, consts, attrs, **options)


def _loads_around_wait(kernel, mode: int, what) -> tuple[list[str], list[str]] | None:
    """Check the wait and the release in the PTX; the SASS global loads before and after
    the wait (None without a wait or without nvdisasm)."""
    ptx = kernel.asm["ptx"]
    assert ptx.count("griddepcontrol.wait") == int(mode > 0), what
    assert ptx.count("griddepcontrol.launch_dependents") == int(mode > 0), what
    sass = _sass(kernel)
    if not mode or not sass:
        return None
    wait = next(i for i, s in enumerate(sass) if s.startswith("ACQBULK"))
    loads = [(i, s.split()[1] if s.startswith("@") else s.split()[0])
             for i, s in enumerate(sass) if "LDG" in s]
    return [op for i, op in loads if i < wait], [op for i, op in loads if i > wait]


def test_dependent_gemvs_build_for_sm90() -> None:
    """The NVFP4 qkvz table tiles (f32 decode) and the FP8 gemv at 8192 x 2048 in every mode:
    wait and release once each with a mode, none off; "weights_first": weights requested
    before the wait, x after it. The h2 decode waits first in every mode."""
    if rerun_without_interpreter(__file__, "build_for_sm90", marker="not slow"):
        return
    from tinyserve.kernels import fp8_triton, nvfp4_triton

    cfg = nvfp4.default_gemv_config(8192, 2048)
    for mode in PDL_MODES.values():
        for is_h2 in (False, True):
            consts = dict(SPLIT_K=1, BLOCK_M=1, BLOCK_N=cfg.block_n, BLOCK_B=cfg.block_b,
                          PREFETCH=cfg.prefetch, VEC=cfg.vec, IS_H2=is_h2, USE_ASM=True,
                          PDL=mode)
            k = _build(nvfp4_triton.nvfp4_gemv_kernel, _TYPES, consts,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            split = _loads_around_wait(k, mode, ("nvfp4", is_h2, mode))
            if split is None:
                continue
            before, after = split
            if is_h2 or mode == PDL_MODES["wait_first"]:
                assert not before, ("nvfp4", is_h2, mode, before)
            else:  # codes (64/128-bit) and scales (8-bit) before, x (16-bit) after
                assert before and "LDG.E.U16" not in before, (mode, before)
                assert after and set(after) == {"LDG.E.U16"}, (mode, after)
        block_n, block_w, split_k = fp8.gemv_tiles(8192, 2048, 132)
        num_warps = fp8.DEFAULT_GEMV.num_warps
        consts = dict(SPLIT_K=split_k, BLOCK_M=1, BLOCK_N=block_n, BLOCK_W=block_w,
                      IS_PER_ROW=True, IS_X_BF16=True, USE_NATIVE=True, PDL=mode)
        k = _build(fp8_triton.fp8_gemv_kernel, _FP8_TYPES, consts, num_warps=num_warps)
        split = _loads_around_wait(k, mode, ("fp8", mode))
        if split is None:
            continue
        before, after = split
        if mode == PDL_MODES["wait_first"]:
            assert not before, ("fp8", mode, before)
        else:  # exactly the code tile's 16-byte loads before; x and the scale after
            tile_loads = block_n * block_w * 4 // (32 * num_warps * 16)
            assert before == ["LDG.E.128"] * tile_loads, (mode, before)
            assert after, mode


# --- on a GPU --------------------------------------------------------------------------------

DEV = "cuda"
needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="programmatic dependent launch needs sm_90+")

CASES = {  # name -> (N, K, tiles)
    "nvfp4_qkvz_f32": (8192, 2048, None),  # the table's tiles
    "nvfp4_h2": (4096, 2048, GemvConfig(16, 128, 4, 0, vec=4, num_stages=3, decode="h2")),
    "nvfp4_persistent": (16384, 2048, GemvConfig(8, 128, 4, 0, vec=4, num_stages=3,
                                                 decode="h2", persistent=6)),
    "fp8": (4096, 2048, None),
}


@pytest.mark.requires_cuda
@needs_sm90
@pytest.mark.parametrize("name", list(CASES))
def test_dependent_gemv_waits_for_its_input(monkeypatch, name: str) -> None:
    n, k, cfg = CASES[name]
    if name.startswith("fp8"):
        w = rand_fp8(n, k, DEV, per_row=True)
        wd, module = dequantize_fp8(w).to(DEV), fp8

        def gemv(x):
            return fp8.fp8_linear(x, w, path="gemv")
    else:
        w = rand_nvfp4(n, k, DEV)
        wd, module = dequantize_nvfp4(w).to(DEV), nvfp4

        def gemv(x):
            return nvfp4.nvfp4_linear(x, w, path="gemv", gemv_config=cfg)
    big = torch.randn(4096, k, device=DEV, dtype=torch.bfloat16) * 0.02
    xbuf = torch.empty(1, k, device=DEV, dtype=torch.bfloat16)
    ref = torch.sum(big, dim=0, keepdim=True).float() @ wd.float().T

    def step() -> torch.Tensor:
        xbuf.fill_(float("nan"))
        torch.sum(big, dim=0, keepdim=True, out=xbuf)  # tens of us: the gemv starts under it
        return gemv(xbuf)

    results = {}
    for mode in PDL_MODES:
        monkeypatch.setattr(module, "GEMV_PDL", mode)
        eager = [step().clone() for _ in range(5)]
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step()
        graphed = []
        for _ in range(5):
            g.replay()
            graphed.append(out.clone())
        torch.cuda.synchronize()
        for y in eager + graphed:
            assert not torch.isnan(y).any(), (name, mode)
            assert torch.equal(y, eager[0]), (name, mode)
        results[mode] = eager[0]
    for mode in PDL_MODES:
        assert torch.equal(results[mode], results["off"]), (name, mode)
    assert rel_err(results["off"], ref) < 1e-2, (name, rel_err(results["off"], ref))
