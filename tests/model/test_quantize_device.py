"""The quantizer gives the same bits on every device: the CUDA-written checkpoint equals the
CPU one byte for byte, and when it does not, the failure names the first differing tensor,
its element and block, and both values."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from tinyserve.kernels.nvfp4.ref import BLOCK, E2M1_VALUES, quantize_fp8, quantize_nvfp4
from tinyserve.model.quantize import quantize_checkpoint

SHAPES = [(1, 16), (7, 48), (64, 256), (256, 1024)]


def _tensor_order(path: Path) -> list[str]:
    """Tensor names of a safetensors file in the order of their bytes in the file."""
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    header.pop("__metadata__", None)
    return sorted(header, key=lambda k: header[k]["data_offsets"][0])


def _describe(name: str, t: torch.Tensor, index: int) -> str:
    """One element of `t` (flat element index) with its raw bits and decoded value."""
    flat = t.reshape(-1)
    bits = flat.view(torch.uint8).reshape(flat.numel(), -1)[index]
    raw = "".join(f"{b:02x}" for b in reversed(bits.tolist()))
    if t.dtype == torch.uint8:  # packed E2M1: two codes, low nibble = even element
        b = int(flat[index])
        return f"0x{raw} (E2M1 {E2M1_VALUES[b & 0xF]}, {E2M1_VALUES[b >> 4]})"
    return f"0x{raw} ({float(flat[index].float())!r})"


def first_difference(a: Path, b: Path) -> str | None:
    """None when the safetensors files `a` and `b` are byte-identical, else a readable account
    of where they first differ: tensor, element, NVFP4 block, both values, how many differ."""
    from safetensors.torch import load_file

    ta, tb = load_file(a), load_file(b)
    if ta.keys() != tb.keys():
        return f"tensor names differ: {sorted(ta.keys() ^ tb.keys())[:5]}"
    differ = []
    for name in _tensor_order(a):
        x, y = ta[name], tb[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            differ.append((name, f"{x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"))
            continue
        xb = x.reshape(-1).view(torch.uint8).reshape(x.numel(), -1)
        yb = y.reshape(-1).view(torch.uint8).reshape(y.numel(), -1)
        bad = (xb != yb).any(dim=-1).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            where = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), x.shape)) \
                if x.dim() else ()
            if x.dtype == torch.uint8 and x.dim() == 2:  # packed codes [out, in/2]
                block = f"block ({where[0]}, {2 * where[1] // BLOCK})"
            elif name.endswith("weight_scale") and x.dim() == 2:  # NVFP4 block scales
                block = f"block {where}"
            else:
                block = "per-tensor"
            differ.append((name, f"{int(bad.numel())} of {x.numel()} elements differ; first "
                                 f"at element {where} ({block}): {_describe(name, x, i)} vs "
                                 f"{_describe(name, y, i)}"))
    if not differ:
        same = a.read_bytes() == b.read_bytes()
        return None if same else "every tensor is equal but the file bytes differ (header?)"
    name, what = differ[0]
    return (f"{len(differ)} tensors differ; first {name}: {what}; all: "
            f"{[n for n, _ in differ][:8]}")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("scale", [1e-3, 0.02, 3.0], ids=lambda s: f"std{s}")
def test_fp8_scale_is_the_cpu_true_division(shape, scale):
    """The FP8 scale divides by a tensor (a true division on CUDA too); on the CPU the bits are
    those of the plain `amax / 448.0` the checkpoints were written with."""
    w = (torch.randn(shape) * scale).to(torch.bfloat16)
    got = quantize_fp8(w)
    want = w.float().abs().max() / 448.0
    assert torch.equal(got.scale.view(torch.int32), want.reshape(()).view(torch.int32))


def test_fp8_zero_tensor():
    got = quantize_fp8(torch.zeros(4, 32, dtype=torch.bfloat16))
    assert float(got.scale) == 1.0 and not got.weight.any()


def test_first_difference_names_tensor_block_and_values(tmp_path):
    from safetensors.torch import save_file

    nv = quantize_nvfp4(torch.randn(8, 64))
    tensors = {"a.weight": nv.packed, "a.weight_scale": nv.block_scale.view(torch.float8_e4m3fn),
               "b.weight_scale": torch.tensor(0.5)}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    assert first_difference(tmp_path / "x.safetensors", tmp_path / "x.safetensors") is None
    packed = nv.packed.clone()
    packed[3, 21] ^= 0x10  # element 43 of row 3: block 2
    save_file({**tensors, "a.weight": packed}, str(tmp_path / "y.safetensors"))
    msg = first_difference(tmp_path / "x.safetensors", tmp_path / "y.safetensors")
    assert msg is not None and msg.startswith("1 tensors differ; first a.weight: 1 of 256 ")
    assert "element (3, 21) (block (3, 2))" in msg and "E2M1" in msg
    scale = torch.tensor(0.5).view(torch.int32).add(1).view(torch.float32)
    save_file({**tensors, "a.weight": packed, "b.weight_scale": scale},
              str(tmp_path / "z.safetensors"))
    msg = first_difference(tmp_path / "x.safetensors", tmp_path / "z.safetensors")
    assert msg is not None and msg.startswith("2 tensors differ; first ")
    assert "0x3f000000 (0.5) vs 0x3f000001 (0.5000000596046448)" in msg
    assert "'a.weight'" in msg and "'b.weight_scale'" in msg


@pytest.mark.requires_cuda
def test_quantize_on_cuda_is_bit_identical(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("bf16")
    for recipe in ("mixed", "nvfp4"):
        a = quantize_checkpoint(src, tmp_path / f"cpu-{recipe}", "modelopt", recipe=recipe)
        b = quantize_checkpoint(src, tmp_path / f"gpu-{recipe}", "modelopt", recipe=recipe,
                                device="cuda")
        msg = first_difference(a / "model.safetensors", b / "model.safetensors")
        assert msg is None, f"recipe {recipe}, CPU vs CUDA: {msg}"


@pytest.mark.requires_cuda
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantizers_on_cuda_match_cpu(shape):
    torch.manual_seed(hash(shape) % 1000)
    w = (torch.randn(shape) * 0.02).to(torch.bfloat16)
    w[0, :BLOCK] = 0  # a zero block (scale replaced by 1.0)
    a, b = quantize_nvfp4(w), quantize_nvfp4(w.cuda())
    assert a.global_scale == b.global_scale
    for field in ("packed", "block_scale"):
        x, y = getattr(a, field), getattr(b, field).cpu()
        bad = (x != y).nonzero()
        assert not bad.numel(), (f"nvfp4 {field}: {bad.shape[0]} differ, first at "
                                 f"{bad[0].tolist()}: {int(x[tuple(bad[0])])} vs "
                                 f"{int(y[tuple(bad[0])])}")
    fa, fb = quantize_fp8(w), quantize_fp8(w.cuda())
    assert float(fa.scale) == float(fb.scale.cpu()), f"{float(fa.scale)!r} vs {float(fb.scale)!r}"
    assert torch.equal(fa.weight, fb.weight.cpu())
