"""The toolkit-free build path (`cuda_build`: NVRTC from the pip wheel, no nvcc, no host
compiler): every kernel instance the launchers can ask for compiles for each GPU generation a
laptop may have, the cache is keyed by what went into the image, and a missing NVRTC is one
line saying what to install. No GPU needed (NVRTC runs on the CPU)."""

from __future__ import annotations

import pytest

from tinyserve.kernels import cuda_build
from tinyserve.kernels.iso import cuda as iso_cuda
from tinyserve.kernels.iso import mma as iso_mma
from tinyserve.kernels.nvfp4 import cuda as nvfp4_cuda


@pytest.fixture
def nvrtc():
    try:
        return cuda_build.nvrtc()
    except cuda_build.KernelBuildError as exc:
        pytest.skip(str(exc))


def instances() -> list[tuple[str, str]]:
    """Every (source, name expression) the launchers of iso_cuda, iso_mma and nvfp4_cuda
    compile."""
    floats = tuple(iso_cuda.CTYPE.values())
    out = [(iso_cuda.STORE, f"iso::store_kernel<{b}, {t}, {i}>") for b in (3, 4)
           for t in floats for i in ("int32_t", "int64_t")]
    out += [(iso_cuda.STORE, f"iso::dequant_rows_kernel<{b}, {t}>") for b in (3, 4)
            for t in floats]
    out += [(iso_mma.SOURCE, f"iso::mma::decode_mma_kernel<{nb}, {w}>") for nb in (1, 2)
            for w in iso_mma.WARPS]
    out += [(iso_mma.SOURCE, f"iso::decode_merge_cols_kernel<{t}, {b}>") for t in floats
            for b in (1, iso_mma.MERGE_BATCH)]
    fmts = ("nvfp4::Bf16", "nvfp4::Fp16")
    out += [(nvfp4_cuda.GEMV, f"nvfp4::nvfp4_gemv_one_row<{t}, {k // 1024}, {r}>")
            for t in fmts for k in nvfp4_cuda.KS for r in nvfp4_cuda.allowed_rows_per_warp(k)]
    out += [(nvfp4_cuda.MOE, f"nvfp4::moe_gate_up<{t}, {h // 1024}>") for t in fmts
            for h in nvfp4_cuda.MOE_HS]
    out += [(nvfp4_cuda.MOE, f"nvfp4::moe_down<{t}, {f}, {nvfp4_cuda.MOE_DOWN_ROWS}>")
            for t in fmts for f in nvfp4_cuda.MOE_FS]
    return out


def test_missing_nvrtc_is_one_line(monkeypatch) -> None:
    monkeypatch.setattr(cuda_build, "_candidates", lambda: ["/nonexistent/libnvrtc.so.12"])
    cuda_build.nvrtc.cache_clear()
    try:
        with pytest.raises(cuda_build.KernelBuildError) as err:
            cuda_build.nvrtc()
    finally:
        cuda_build.nvrtc.cache_clear()
    msg = str(err.value)
    assert "\n" not in msg and "NVRTC" in msg and "pip install nvidia-cuda-nvrtc" in msg


def test_build_is_cached_by_what_went_in(nvrtc, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))
    name = "iso::dequant_rows_kernel<3, float>"
    cubin = cuda_build.build(iso_cuda.STORE, (name,), 86)
    assert not cubin.is_ptx and cubin.image[:4] == b"\x7fELF"
    assert cubin.lowered[name].startswith("_ZN3iso19dequant_rows_kernel")
    ptx = cuda_build.build(iso_cuda.STORE, (name,), 86, ptx=True)
    assert ptx.is_ptx and b".target sm_86" in ptx.image
    assert len(list((tmp_path / "kernels").glob("*.cubin"))) == 1
    # the second build of each comes from the cache, not from NVRTC
    monkeypatch.setattr(cuda_build, "_compile", lambda *a: pytest.fail("compiled again"))
    assert cuda_build.build(iso_cuda.STORE, (name,), 86) == cubin
    assert cuda_build.build(iso_cuda.STORE, (name,), 86, ptx=True) == ptx


def test_a_compile_error_names_the_source(nvrtc, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))
    with pytest.raises(cuda_build.KernelBuildError, match="iso_store.cu"):
        cuda_build.build(iso_cuda.STORE, ("iso::no_such_kernel<3>",), 86)


# (arch, sources): every instance for a laptop generation (sm_86, cubins: ptxas runs too);
# PTX for the generations whose code differs (sm_89: the E4M3 conversion; sm_120: Blackwell
# consumer GPUs); sm_90's cubins are built by the kernels' register tests
TARGETS = [(86, None), (89, (nvfp4_cuda.GEMV, nvfp4_cuda.MOE)),
           (120, (iso_mma.SOURCE, nvfp4_cuda.GEMV, nvfp4_cuda.MOE))]


@pytest.mark.slow
@pytest.mark.parametrize("arch,sources", TARGETS, ids=[f"sm_{a}" for a, _ in TARGETS])
def test_every_kernel_instance_compiles(nvrtc, arch: int, sources) -> None:
    if arch not in cuda_build.supported_archs():
        pytest.skip(f"NVRTC {cuda_build.nvrtc_version()} does not build sm_{arch}")
    for source, name in instances():
        if sources is None or source in sources:
            built = cuda_build.build(source, (name,), arch, ptx=arch != 86)
            assert built.image and name in built.lowered
