"""NVFP4 and FP8 weights in pure torch: decode, encode, dequantize, quantize, reference linear.

NVFP4 (specs/nvfp4.md §1): blocks of 16 inputs of 4-bit E2M1 codes (two per byte, low nibble
first), an E4M3 scale per block (raw uint8 bits) and one fp32 global scale:
W = E2M1[code] * e4m3(block_scale) * global_scale. Runs on CPU and CUDA, no float8 dtype."""

from __future__ import annotations

import torch

from tinyserve.core import DenseWeight, FP8Weight, LinearWeight, NVFP4Weight

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Magnitude decision boundaries between codes 0..7; ties go to the even code.
_BOUNDS_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)  # tie -> lower (even) code: count only when above
_BOUNDS_TIE_UP = (0.75, 1.75, 3.5)  # tie -> upper (even) code: count when at or above


def _exp2i(e: torch.Tensor) -> torch.Tensor:
    """2**e as fp32, exactly, for integer e in [-126, 127] (built from the exponent bits)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def e4m3_to_float(bits: torch.Tensor) -> torch.Tensor:
    """Decode FP8 E4M3 (float8_e4m3fn) from its uint8 bits to fp32; 0x7F / 0xFF give NaN."""
    b = bits.to(torch.int32)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).to(torch.float32)
    # E > 0: 2**(E-7) * (1 + m/8); E == 0: 2**-6 * m/8 = m * 2**-9 (all products exact)
    mag = torch.where(exp == 0, man * 2.0**-9, (8.0 + man) * _exp2i(exp - 10))
    mag = torch.where((b & 0x7F) == 0x7F, torch.full_like(mag, float("nan")), mag)
    return torch.where((b & 0x80) != 0, -mag, mag)


def float_to_e4m3_bits(x: torch.Tensor) -> torch.Tensor:
    """Encode to FP8 E4M3 bits (uint8), round to nearest even, saturating at +-448; NaN -> 0x7F."""
    x = x.to(torch.float32)
    a = x.abs()
    mant, exp = torch.frexp(a)  # a = mant * 2**exp, mant in [0.5, 1)
    e = (exp - 1).clamp(min=-6)  # unbiased exponent, subnormals share -6
    # a / 2**(e-3) lies in [8, 16) for normals, [0, 8) for subnormals; RNE to an integer.
    steps = torch.round(a * _exp2i((3 - e).clamp(max=127))).to(torch.int32)
    bits = torch.where(a >= 2.0**-6, ((e + 7) << 3) + steps - 8, steps)
    bits = torch.where(a > E4M3_MAX, torch.full_like(bits, 0x7E), bits.clamp(max=0x7E))
    bits = torch.where(torch.isnan(x), torch.full_like(bits, 0x7F), bits)
    sign = torch.signbit(x) & ~torch.isnan(x)
    bits = torch.where(sign, bits | 0x80, bits)
    return bits.to(torch.uint8)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> codes uint8 [..., n]; element 2j is the low nibble of byte j."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., n] (n even) -> packed uint8 [..., n/2]."""
    codes = codes.to(torch.uint8)
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 values already divided by their scale -> E2M1 codes uint8 (saturating at 6)."""
    a = x.abs()
    down = torch.tensor(_BOUNDS_TIE_DOWN, dtype=a.dtype, device=a.device)
    up = torch.tensor(_BOUNDS_TIE_UP, dtype=a.dtype, device=a.device)
    # magnitude index = #(bounds < a) over tie-down bounds + #(bounds <= a) over tie-up bounds
    idx = torch.bucketize(a, down, right=False) + torch.bucketize(a, up, right=True)
    idx = torch.where(x < 0, idx | 8, idx)
    return idx.to(torch.uint8)


def dequantize_nvfp4(w: NVFP4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NVFP4Weight -> dense [out, in] in `dtype` (computed in fp32)."""
    codes = unpack_e2m1(w.packed).to(torch.int64)  # [out, in]
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.packed.device)[codes]
    scales = e4m3_to_float(w.block_scale).repeat_interleave(BLOCK, dim=-1)  # [out, in]
    glob = torch.tensor(w.global_scale, dtype=torch.float32, device=values.device)
    return (values * scales * glob).to(dtype)


def dequantize_fp8(w: FP8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8Weight -> dense [out, in]: e4m3(weight) * scale (scalar or per-row [out, 1])."""
    scale = w.scale.to(device=w.weight.device, dtype=torch.float32)
    if scale.dim() == 1:
        scale = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(())
    return (e4m3_to_float(w.weight) * scale).to(dtype)


def dequantize(w: LinearWeight, dtype: torch.dtype) -> torch.Tensor:
    """The dense [out, in] weight of any storage (dense, NVFP4, FP8), in `dtype`."""
    if isinstance(w, DenseWeight):
        return w.weight.to(dtype)
    if isinstance(w, NVFP4Weight):
        return dequantize_nvfp4(w, dtype)
    if isinstance(w, FP8Weight):
        return dequantize_fp8(w, dtype)
    raise TypeError(f"unknown weight storage {type(w).__name__}")


def nvfp4_global_scale(amax: float) -> float:
    """weight_scale_2 = amax / (6 * 448) as an fp32 value whose fp32 reciprocal maps back to it.

    NOTE: the reciprocal round trip makes the compressed-tensors form (2688 / amax, divided)
    dequantize bit-identically to the ModelOpt form; it moves the scale by at most a few ulp.
    """
    if not amax > 0 or amax == float("inf"):
        return 1.0
    s = torch.tensor(amax / (E2M1_MAX * E4M3_MAX), dtype=torch.float32)
    inf = torch.tensor(float("inf"))
    while (1.0 / (1.0 / s)) != s:
        s = torch.nextafter(s, inf)
    return float(s)


def quantize_nvfp4(w: torch.Tensor) -> NVFP4Weight:
    """Quantize a dense weight [out, in] (in % 16 == 0) to NVFP4 (specs/nvfp4.md §1 quantizer).

    weight_scale_2 = amax / 2688; block scale = e4m3(amax_block / (6 * weight_scale_2)) with a
    zero scale replaced by 1.0; codes = E2M1 round (ties to even) of w / (block * global).
    """
    if w.dim() != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"quantize_nvfp4 needs [out, in] with in % {BLOCK} == 0, "
                         f"got {list(w.shape)}")
    x = w.to(torch.float32)
    out, inp = x.shape
    glob = nvfp4_global_scale(float(x.abs().max()) if x.numel() else 0.0)
    g = torch.tensor(glob, dtype=torch.float32, device=x.device)
    blocks = x.reshape(out, inp // BLOCK, BLOCK)
    amax_blk = blocks.abs().amax(dim=-1)  # [out, in/16]
    scale_bits = float_to_e4m3_bits(amax_blk / (E2M1_MAX * g))
    scale_bits = torch.where(scale_bits == 0, torch.full_like(scale_bits, 0x38), scale_bits)
    denom = (e4m3_to_float(scale_bits) * g).unsqueeze(-1)  # [out, in/16, 1]
    codes = round_to_e2m1(blocks / denom).reshape(out, inp)
    return NVFP4Weight(packed=pack_e2m1(codes), block_scale=scale_bits, global_scale=glob)


def quantize_fp8(w: torch.Tensor, *, per_channel: bool = False) -> FP8Weight:
    """Quantize [out, in] to FP8 E4M3 with a per-tensor (or per-row [out, 1]) scale amax/448.

    The same bits on every device. NOTE: on CUDA `tensor / python_float` runs as a multiply
    by the fp32 reciprocal (1 / 448 is inexact: one ulp off a true division for some amax);
    dividing by a tensor is a true IEEE division on CPU and CUDA alike.
    """
    x = w.to(torch.float32)
    amax = x.abs().amax(dim=1, keepdim=True) if per_channel else x.abs().max().reshape(())
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    return FP8Weight(weight=float_to_e4m3_bits(x / scale), scale=scale)


def nvfp4_linear_ref(x: torch.Tensor, w: NVFP4Weight) -> torch.Tensor:
    """y = x @ dequantize(w).T in fp32, cast back to x.dtype. x [..., in] -> [..., out]."""
    wd = dequantize_nvfp4(w, torch.float32).to(x.device)
    return (x.to(torch.float32) @ wd.T).to(x.dtype)


def fp8_linear_ref(x: torch.Tensor, w: FP8Weight) -> torch.Tensor:
    """y = x @ dequantize(w).T in fp32, cast back to x.dtype."""
    wd = dequantize_fp8(w, torch.float32).to(x.device)
    return (x.to(torch.float32) @ wd.T).to(x.dtype)
