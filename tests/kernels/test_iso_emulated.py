"""The ISO store and dequant kernels and their launchers (`iso_cuda`), compiled for the CPU
under a small CUDA emulation (emulation.py, cuda_emu/emu.h), against the torch references:
exact store and dequant bytes on the golden rows, and the extend attention built on the
dequant. Checks the launch arithmetic with the kernels' indexing on machines without a GPU
(the decode kernel's emulated tests are in test_iso_mma.py); skipped when no C++20 compiler
is available."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels import emulation
from tinyserve.kernels import cuda_launch, iso
from tinyserve.kernels.iso import cuda as iso_cuda
from tinyserve.kernels.iso import extend as iso_extend


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    return emulation.EmuBackend(tmp_path_factory.mktemp("iso_emu"))


@pytest.fixture
def emu(backend):
    with cuda_launch.use_backend(backend):
        yield backend


@pytest.mark.parametrize("fmt", ["iso3", "iso4"])
def test_store_golden_and_dequant(emu, shared_dir, fmt: str) -> None:
    g = np.load(shared_dir / "data" / "iso_golden.npz")
    x = torch.from_numpy(g["x"]).contiguous()
    n, rb = x.shape[0], iso.packed_row_bytes(256, fmt)
    kc = torch.full((n + 3, 1, rb), 0xAB, dtype=torch.uint8)
    vc = kc.clone()
    loc = torch.randperm(n + 3)[:n].int()
    rows = x[:, None]  # [N, 1, 256]
    iso_cuda.iso_store(kc, vc, loc, rows, rows, fmt)
    got = kc[loc.long(), 0].numpy()
    assert np.array_equal(got, g[fmt]), np.nonzero((got != g[fmt]).any(1))[0].tolist()
    assert torch.equal(kc, vc)
    kb = torch.randn(9, 2, 256).bfloat16()
    kc2 = torch.zeros(9, 2, rb, dtype=torch.uint8)
    vc2 = torch.zeros(9, 2, rb, dtype=torch.uint8)
    loc2 = torch.arange(9)
    iso_cuda.iso_store(kc2, vc2, loc2, kb, kb, fmt)
    assert torch.equal(kc2, iso.quantize_ref(kb.float(), fmt))
    out = torch.full((9, 2, 256), float("nan"))
    assert iso_cuda.iso_dequant_rows(kc2, loc2, fmt, 256, torch.float32, out=out) is out
    assert torch.equal(out, iso.dequantize_ref(kc2, fmt, 256))
    out_hm = torch.full((2, 9, 256), float("nan"))  # head-major layout
    iso_cuda.iso_dequant_rows(kc2, loc2, fmt, 256, torch.float32, head_major=True, out=out_hm)
    assert torch.equal(out_hm, out.transpose(0, 1))


@pytest.mark.parametrize("fmt", ["iso3", "iso4"])
def test_extend_on_cpu(emu, fmt: str) -> None:
    """iso_extend_attention's prefix + chunk rows (the row-dequant kernel writing into a
    slice of them) and lower-right causal attention (SDPA on CPU)."""
    torch.manual_seed(4)
    hq, hkv, d, ps = 8, 2, 128, 4
    prefixes, chunks = [0, 6, 13], [5, 3, 1]
    table = torch.arange(3 * 8, dtype=torch.int32).reshape(3, 8)
    kc = iso.quantize_ref(torch.randn(3 * 8 * ps, hkv, d), fmt)
    vc = iso.quantize_ref(torch.randn(3 * 8 * ps, hkv, d), fmt)
    n = sum(chunks)
    q, k, v = torch.randn(n, hq, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    out = iso_extend.iso_extend_attention(q, k, v, kc, vc, table, chunks, prefixes, ps, fmt,
                                          d ** -0.5)
    start = 0
    for b, (p, m) in enumerate(zip(prefixes, chunks, strict=True)):
        rows = iso.gather_rows(kc, table[b], ps, p)
        kk = torch.cat([iso.dequantize_ref(rows, fmt, d), k[start:start + m]])
        vv = torch.cat([iso.dequantize_ref(iso.gather_rows(vc, table[b], ps, p), fmt, d),
                        v[start:start + m]])
        ref = iso.attention_oracle(q[start:start + m], kk, vv, p, d ** -0.5)
        torch.testing.assert_close(out[start:start + m], ref, rtol=1e-4, atol=1e-5)
        start += m
