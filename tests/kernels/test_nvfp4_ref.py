"""NVFP4 / FP8 pure-torch reference: codecs against torch's float8 dtype, the quantizer's bounds
and rounding rules, nibble order, and the two global-scale conventions."""

from __future__ import annotations

import pytest
import torch

from tinyserve.core import FP8Weight, NVFP4Weight
from tinyserve.kernels.nvfp4.ref import (
    E2M1_VALUES,
    dequantize_fp8,
    dequantize_nvfp4,
    e4m3_to_float,
    float_to_e4m3_bits,
    fp8_linear_ref,
    nvfp4_global_scale,
    nvfp4_linear_ref,
    pack_e2m1,
    quantize_fp8,
    quantize_nvfp4,
    round_to_e2m1,
    unpack_e2m1,
)

ALL_BITS = torch.arange(256, dtype=torch.uint8)
FINITE = (ALL_BITS & 0x7F) != 0x7F


def test_e4m3_decode_matches_torch_on_all_254_codes():
    ref = ALL_BITS.view(torch.float8_e4m3fn).to(torch.float32)
    got = e4m3_to_float(ALL_BITS)
    assert int(FINITE.sum()) == 254
    assert torch.equal(got[FINITE], ref[FINITE])
    assert torch.signbit(got[FINITE]).equal(torch.signbit(ref[FINITE]))  # -0 stays -0
    assert torch.isnan(got[~FINITE]).all()
    assert float(got.nan_to_num(0).abs().max()) == 448.0


def test_e4m3_encode_round_trips_every_code():
    values = ALL_BITS.view(torch.float8_e4m3fn).to(torch.float32)[FINITE]
    assert torch.equal(float_to_e4m3_bits(values), ALL_BITS[FINITE])


def test_e4m3_encode_is_rne_like_torch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50_000, generator=g) * torch.exp(4 * torch.randn(50_000, generator=g))
    x = x.clamp(-448, 448)
    pos = ALL_BITS[:0x7F].view(torch.float8_e4m3fn).to(torch.float32)
    mids = (pos[1:] + pos[:-1]) / 2  # exact ties: RNE decides
    for v in (x, mids, -mids):
        assert torch.equal(float_to_e4m3_bits(v), v.to(torch.float8_e4m3fn).view(torch.uint8))


def test_e4m3_encode_saturates_and_keeps_nan():
    x = torch.tensor([448.0, 464.0, 500.0, 1e30, float("inf"), -1e9, float("nan")])
    assert float_to_e4m3_bits(x).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F]


def test_nibble_order_low_is_even_element():
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0xF3]]
    assert torch.equal(unpack_e2m1(packed), codes)
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (7, 64), generator=g, dtype=torch.uint8)
    assert torch.equal(unpack_e2m1(pack_e2m1(codes)), codes)


def test_e2m1_rounding_boundaries_and_ties():
    table = torch.tensor(E2M1_VALUES)
    x = torch.tensor([0.0, 0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, 100.0])
    want = [0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0]
    assert table[round_to_e2m1(x).long()].tolist() == want
    assert table[round_to_e2m1(-x).long()].tolist() == [-v for v in want]
    # every representable value maps to itself
    assert torch.equal(table[round_to_e2m1(table).long()], table)


def test_dequantize_hand_built_weight():
    # one row, 16 inputs: codes 0..15, block scale 2.0 (0x40), global 0.5 -> E2M1 values
    codes = torch.arange(16, dtype=torch.uint8).reshape(1, 16)
    w = NVFP4Weight(pack_e2m1(codes), torch.tensor([[0x40]], dtype=torch.uint8), 0.5)
    assert dequantize_nvfp4(w).flatten().tolist() == list(E2M1_VALUES)
    assert w.shape == (1, 16)


@pytest.mark.parametrize("shape", [(1, 16), (8, 64), (33, 128), (64, 48)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0], ids=lambda s: f"amp{s:g}")
def test_quantize_dequantize_error_bound(shape, scale):
    g = torch.Generator().manual_seed(hash((shape, scale)) % 2**31)
    w = torch.randn(shape, generator=g) * scale
    q = quantize_nvfp4(w)
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (shape[0], shape[1] // 2)
    assert q.block_scale.dtype == torch.uint8 and q.block_scale.shape == (shape[0],
                                                                        shape[1] // 16)
    assert abs(q.global_scale - float(w.abs().max()) / 2688) <= 1e-6 * q.global_scale
    d = dequantize_nvfp4(q)
    # Per element: at most half an E2M1 step (2 at the top, i.e. 1/6 of the block max) plus
    # the block-scale rounding (2**-4 relative).
    blk_max = w.abs().reshape(shape[0], -1, 16).amax(-1).repeat_interleave(16, dim=1)
    assert ((d - w).abs() <= blk_max * (1 / 6 + 1 / 16) * 1.0001 + 1e-12).all()
    rel = (d - w).norm() / w.norm()
    assert rel < 0.15
    # the largest element of the tensor is exact up to fp8/fp32 rounding
    i = w.abs().argmax()
    assert abs(float(d.flatten()[i] - w.flatten()[i])) <= 0.07 * float(w.abs().max())


def test_quantize_zero_and_constant_blocks():
    w = torch.zeros(4, 32)
    w[1, 16:] = 3.0
    q = quantize_nvfp4(w)
    d = dequantize_nvfp4(q)
    torch.testing.assert_close(d, w, rtol=1e-6, atol=0)  # global scale is fp32(3 / 2688)
    assert (e4m3_to_float(q.block_scale)[0] == 1.0).all()  # zero block scale -> 1.0
    z = quantize_nvfp4(torch.zeros(2, 16))
    assert z.global_scale == 1.0 and torch.equal(dequantize_nvfp4(z), torch.zeros(2, 16))


def test_quantize_rejects_bad_shape():
    with pytest.raises(ValueError, match="in % 16"):
        quantize_nvfp4(torch.randn(4, 20))


def test_global_scale_reciprocal_round_trips():
    g = torch.Generator().manual_seed(3)
    for amax in (torch.rand(500, generator=g) * 100).tolist() + [1e-20, 3.0, 2688.0]:
        s = torch.tensor(nvfp4_global_scale(amax), dtype=torch.float32)
        assert float(s) == nvfp4_global_scale(amax)  # an fp32 value
        assert torch.equal(1.0 / (1.0 / s), s)
        assert abs(float(s) - amax / 2688) <= 4e-7 * amax / 2688


def test_both_conventions_dequantize_identically():
    # ModelOpt multiplies by weight_scale_2; compressed-tensors stores 1/weight_scale_2 and
    # divides. Folding (global = fp32(1 / weight_global_scale)) gives the same weights bit for bit.
    g = torch.Generator().manual_seed(4)
    for _ in range(20):
        w = torch.randn(16, 64, generator=g) * float(torch.rand(1, generator=g) * 10)
        q = quantize_nvfp4(w)
        wgs = torch.tensor(1.0 / q.global_scale, dtype=torch.float32)
        folded = float(torch.tensor(1.0 / float(wgs), dtype=torch.float32))
        ct = NVFP4Weight(q.packed, q.block_scale, folded)
        assert torch.equal(dequantize_nvfp4(ct), dequantize_nvfp4(q))
        divided = (torch.tensor(E2M1_VALUES)[unpack_e2m1(q.packed).long()]
                   * e4m3_to_float(q.block_scale).repeat_interleave(16, 1)) / wgs
        torch.testing.assert_close(divided, dequantize_nvfp4(q), rtol=2**-23, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nvfp4_linear_ref(dtype):
    g = torch.Generator().manual_seed(5)
    q = quantize_nvfp4(torch.randn(24, 64, generator=g))
    x = torch.randn(3, 5, 64, generator=g).to(dtype)
    y = nvfp4_linear_ref(x, q)
    assert y.dtype == dtype and y.shape == (3, 5, 24)
    ref = (x.double() @ dequantize_nvfp4(q).double().T)
    torch.testing.assert_close(y.double(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("per_channel", [False, True], ids=["tensor", "channel"])
def test_fp8_quantize_dequantize(per_channel):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(12, 32, generator=g) * 5
    q = quantize_fp8(w, per_channel=per_channel)
    assert q.weight.dtype == torch.uint8
    assert q.scale.shape == ((12, 1) if per_channel else ())
    d = dequantize_fp8(q)
    torch.testing.assert_close(d, w, rtol=2**-3, atol=1e-6)
    native = q.weight.view(torch.float8_e4m3fn).float() * q.scale
    assert torch.equal(d, native)
    # a [1] scale and an [out] scale are accepted too
    flat = FP8Weight(q.weight, q.scale.reshape(-1) if per_channel else q.scale.reshape(1))
    assert torch.equal(dequantize_fp8(flat), d)
    x = torch.randn(2, 32, generator=g)
    torch.testing.assert_close(fp8_linear_ref(x, q), x @ d.T)


@pytest.mark.requires_cuda
def test_reference_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(96, 256, generator=g) * 3
    cpu = quantize_nvfp4(w)
    gpu = quantize_nvfp4(w.cuda())
    assert gpu.packed.is_cuda and gpu.block_scale.is_cuda
    assert torch.equal(gpu.packed.cpu(), cpu.packed)
    assert torch.equal(gpu.block_scale.cpu(), cpu.block_scale)
    assert gpu.global_scale == cpu.global_scale
    assert torch.equal(dequantize_nvfp4(gpu).cpu(), dequantize_nvfp4(cpu))
    bits = ALL_BITS.cuda()
    native = bits.view(torch.float8_e4m3fn).float()
    finite = FINITE.cuda()
    assert torch.equal(e4m3_to_float(bits)[finite], native[finite])
    x = (torch.randn(10_000, device="cuda") * 100).clamp(-448, 448)
    assert torch.equal(float_to_e4m3_bits(x), x.to(torch.float8_e4m3fn).view(torch.uint8))
    xa = torch.randn(4, 256, generator=g).to(torch.bfloat16)
    y = nvfp4_linear_ref(xa.cuda(), gpu)
    torch.testing.assert_close(y.cpu(), nvfp4_linear_ref(xa, cpu), rtol=1e-2, atol=1e-2)
