"""The CUDA NVFP4 kernels (csrc/nvfp4_gemv.cu, nvfp4_moe.cu) against the torch references.

Every check runs twice through the library's launchers: on the CPU, the kernels compiled
under the CUDA emulation (emulation.py, fp16 arithmetic emulated) at small shapes and every
rows-per-warp variant; on a GPU, at the 35B-A3B shapes. Outputs are poisoned with NaN and rows
past N must stay untouched. Bounds: one-hot x with a power-of-two global scale is bit-exact
(every code at every nibble position, every non-NaN scale byte); random x within relative
Frobenius error 3e-3 (fp16 products and 8-term sums, then fp32); the MoE decode within 5e-3
(its intermediate is rounded to fp16 too).
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.kernels import emulation
from tests.kernels.sm90_build import ptxas_entries
from tinyserve.core import NVFP4Weight
from tinyserve.kernels import cuda_launch
from tinyserve.kernels.nvfp4 import cuda as nvfp4_cuda
from tinyserve.kernels.nvfp4.ref import dequantize_nvfp4

BOUND = 3e-3
DTYPES = (torch.bfloat16, torch.float16)
SHAPES = {"qkvz": (8192, 2048), "o_proj": (2048, 4096), "gate_up": (1024, 2048),
          "lm_head": (248320, 2048), "odd": (1000, 1024)}


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return emulation.EmuBackend(tmp_path_factory.mktemp("nvfp4_emu"))


@pytest.fixture(params=["emu", pytest.param("cuda", marks=pytest.mark.requires_cuda)])
def device(request):
    """"cuda", or "cpu" with the emulated kernels installed."""
    if request.param == "cuda":
        yield "cuda"
    else:
        with cuda_launch.use_backend(request.getfixturevalue("emulated")):
            yield "cpu"


@pytest.fixture
def gemv(device):
    """gemv(x [1, K], w, rows_per_warp) -> y [1, N], written into a NaN-poisoned buffer one
    row longer than N whose last row is checked to stay NaN."""
    def run(x, w, r):
        n = w.packed.shape[0]
        buf = torch.full((1, n + 1), float("nan"), dtype=x.dtype, device=x.device)
        nvfp4_cuda.gemv_one_row(x, w, rows_per_warp=r, out=buf[:, :n])
        assert torch.isnan(buf[0, n]), "a row past N was written"
        return buf[:, :n]

    run.device = device
    return run


def rand_weight(n: int, k: int, device: str, global_scale: float | None = None) -> NVFP4Weight:
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    scale = torch.randint(0x30, 0x48, (n, k // 16), dtype=torch.uint8, device=device)
    return NVFP4Weight(packed, scale, global_scale or 0.5 / k**0.5)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.double().norm())


def small_or_full(gemv, small: tuple[int, int], name: str) -> tuple[int, int]:
    return SHAPES[name] if gemv.device == "cuda" else small


@pytest.mark.parametrize("k", nvfp4_cuda.KS)
def test_random_rows_every_variant(gemv, k):
    # N not a multiple of any CTA's rows: the last CTA's spare warps load row N - 1 again
    n = 1000 if gemv.device == "cuda" else 37
    w = rand_weight(n, k, gemv.device)
    ref_w = dequantize_nvfp4(w)
    for dtype in DTYPES:
        x = torch.randn(1, k, device=gemv.device).to(dtype)
        ref = x.float() @ ref_w.T
        for r in nvfp4_cuda.allowed_rows_per_warp(k):
            y = gemv(x, w, r)
            assert y.dtype == dtype and not torch.isnan(y).any()
            assert rel_err(y, ref) < BOUND, (dtype, r, rel_err(y, ref))


def test_one_hot_x_is_exact_for_every_code_and_scale(gemv):
    # row r holds byte (r + 3i) % 256 at byte i and scale byte (r + 7b) % 256 in block b
    # (the E4M3 NaN bytes 0x7F / 0xFF replaced: checkpoints never hold them), so over 256 rows
    # every nibble position of a 16-byte piece meets every code and every block every scale;
    # x = -1.5 at one input, a power-of-two global scale: every product is exact in fp16 and
    # fp32, so y must equal the reference bit for bit (after the same output rounding)
    n, k = 256, 1024
    rows = torch.arange(n)[:, None]
    packed = ((rows + 3 * torch.arange(k // 2)) % 256).to(torch.uint8)
    scale = ((rows + 7 * torch.arange(k // 16)) % 256).to(torch.uint8)
    scale[(scale & 0x7F) == 0x7F] -= 1
    w = NVFP4Weight(packed.to(gemv.device), scale.to(gemv.device), 2.0**-5)
    ref_w = dequantize_nvfp4(w)
    for dtype in DTYPES:
        for pos in (0, 5, 10, 15, 17, 22, 27, 28, 545, 1023):  # nibble 0..7 of words 0..3
            x = torch.zeros(1, k, dtype=dtype, device=gemv.device)
            x[0, pos] = -1.5
            y = gemv(x, w, 4)
            ref = (x.float() @ ref_w.T).to(dtype)
            assert torch.equal(y, ref), (dtype, pos, (y != ref).nonzero()[:4].tolist())


def test_zero_and_wide_magnitudes(gemv):
    # each block of 16 inputs takes its own power-of-two scale: rows of x at 1e-30 or 1e30,
    # or with blocks from 1e-30 to 1e30 side by side, keep fp16's relative error
    n, k = small_or_full(gemv, (40, 2048), "qkvz")
    w = rand_weight(n, k, gemv.device)
    zero = gemv(torch.zeros(1, k, dtype=torch.bfloat16, device=gemv.device), w, 4)
    assert torch.equal(zero, torch.zeros_like(zero))
    ref_w = dequantize_nvfp4(w).double()
    mags = torch.tensor([1e-30, 1e-3, 1.0, 3e4, 1e30], device=gemv.device)
    per_block = mags[torch.arange(k, device=gemv.device) // 16 % 5]
    for scale in (mags[0], mags[-1], per_block):
        x = (torch.randn(1, k, device=gemv.device) * scale).to(torch.bfloat16)
        y = gemv(x, w, 2)
        assert rel_err(y, x.double() @ ref_w.T) < BOUND, scale


def test_non_finite_x(gemv):
    n, k = 40, 1024
    w = rand_weight(n, k, gemv.device)
    ref_w = dequantize_nvfp4(w)
    for dtype in DTYPES:
        x = torch.randn(1, k, device=gemv.device).to(dtype)
        x[0, 17] = float("inf")
        y = gemv(x, w, 1).float()
        ref = x.float() @ ref_w.T
        assert torch.equal(torch.isinf(y), torch.isinf(ref))
        assert torch.equal(torch.isnan(y), torch.isnan(ref))
        assert torch.equal(torch.sign(y[torch.isinf(y)]), torch.sign(ref[torch.isinf(ref)]))
        x[0, 600] = float("nan")
        assert torch.isnan(gemv(x, w, 1)).all()


def test_launcher_refuses_what_the_kernel_does_not_take():
    w = rand_weight(8, 1024, "cpu")
    x = torch.randn(1, 1024, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        nvfp4_cuda.gemv_one_row(x, w)
    assert not nvfp4_cuda.takes(x, w)
    assert nvfp4_cuda.allowed_rows_per_warp(4096) == (1, 2)
    # qkvz fits one wave of 2 CTAs per SM with 4 rows per warp on 132 SMs; the lm_head never
    # does and takes the most rows
    assert nvfp4_cuda.default_rows_per_warp(8192, 2048, 132) == 4
    assert nvfp4_cuda.default_rows_per_warp(2048, 4096, 132) == 1
    assert nvfp4_cuda.default_rows_per_warp(248320, 2048, 132) == 4


@pytest.mark.requires_cuda
@pytest.mark.parametrize("name", list(SHAPES))
def test_model_shapes_default_path_and_graph(poison, name):
    # nvfp4_linear's default M = 1 path (CUDA where it takes the shape, else Triton), bf16
    # and fp16, eagerly and replayed from a CUDA graph
    from tinyserve.kernels.nvfp4.linear import nvfp4_linear

    n, k = SHAPES[name]
    w = rand_weight(n, k, "cuda")
    ref_w = dequantize_nvfp4(w)
    for dtype in DTYPES:
        x = torch.randn(1, k, device="cuda").to(dtype)
        ref = x.float() @ ref_w.T
        assert rel_err(nvfp4_linear(x, w), ref) < BOUND
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = nvfp4_linear(x, w)
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(y, ref) < BOUND, (name, dtype)
    assert nvfp4_cuda.takes(x, w) == (k in nvfp4_cuda.KS)


# --- the MoE decode -------------------------------------------------------------------------

MOE_BOUND = 5e-3


def moe_layer(h: int, f: int, experts: int, device: str):
    """`experts` random NVFP4 experts in random slots of an (experts + 2)-slot buffer, the
    slot of each expert, and a shared expert in its own slots."""
    from tinyserve.kernels.moe.fused import (
        allocate_expert_slots,
        single_expert_slots,
        write_slot,
    )

    def expert():
        return rand_weight(f, h, device), rand_weight(f, h, device), rand_weight(h, f, device)

    slots = allocate_expert_slots(experts + 2, h, f, fp4=True, device=device)
    slot_of = torch.randperm(experts + 2, device=device)[:experts]
    for i in range(experts):
        write_slot(slots, int(slot_of[i]), *expert())
    return slots, slot_of, single_expert_slots(*expert())


@pytest.fixture
def moe(device, poison):
    """moe(x, ids, wts, topk, slots, shared, logit) -> [N, H] through the CUDA MoE decode (the
    emulated kernels on the CPU), its intermediate and output poisoned with NaN."""

    def run(x, ids, wts, topk, slots, shared, logit, out_dtype=None):
        return nvfp4_cuda.moe_decode(x, ids.reshape(-1), wts.reshape(-1), topk, slots, shared,
                                     logit, out_dtype)

    run.device = device
    return run


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
def test_moe_decode_matches_the_reference(moe, shared):
    # the emulation at H 1024, F 256 (8 pairs side by side per warp), the GPU at 35B-A3B's
    # 2048 / 512; 1 token (int32 ids, fp32 routing weights) and 3 (int64, bf16)
    from tinyserve.kernels.moe.fused import fused_moe_ref

    h, f, experts, topk = (2048, 512, 64, 8) if moe.device == "cuda" else (1024, 256, 6, 3)
    slots, slot_of, sh = moe_layer(h, f, experts, moe.device)
    for n, id_dtype, w_dtype in ((1, torch.int32, torch.float32),
                                 (3, torch.int64, torch.bfloat16)):
        ids = torch.stack([slot_of[torch.randperm(experts, device=moe.device)[:topk]]
                           for _ in range(n)]).to(id_dtype)
        wts = torch.softmax(torch.randn(n, topk, device=moe.device), -1).to(w_dtype)
        x = torch.randn(n, h, device=moe.device).to(torch.bfloat16)
        logit = torch.randn(n, 3, device=moe.device).to(torch.bfloat16)[:, 1:2] if shared \
            else None
        kw = {"shared_slots": sh, "shared_logit": logit} if shared else {}
        ref = fused_moe_ref(x, ids, wts, slots, **kw).float()
        y = moe(x, ids, wts, topk, slots, sh if shared else None, logit)
        assert y.dtype == x.dtype and not torch.isnan(y).any()
        assert rel_err(y, ref) < MOE_BOUND, (n, rel_err(y, ref))
        # the sum unrounded (for a CPU part to join): the same sum, rounded once by the caller
        y32 = moe(x, ids, wts, topk, slots, sh if shared else None, logit, torch.float32)
        assert y32.dtype == torch.float32 and torch.equal(y32.to(x.dtype), y)
        assert not torch.equal(y32, y.float())


def test_moe_decode_is_the_default_fused_path(monkeypatch):
    # a decode-sized NVFP4 call: the CUDA decode with the shared expert where it takes the
    # call (and `fuses_shared_expert` says so), else the dot path and the shared expert as a
    # second, one-expert call
    from tinyserve.kernels.moe import fused as fm

    calls = []
    takes = [True]
    monkeypatch.setattr(nvfp4_cuda, "moe_takes", lambda *a: takes[0])
    monkeypatch.setattr(nvfp4_cuda, "moe_decode", lambda *a: calls.append("cuda") or a[0])
    dot = fm._moe_dot
    monkeypatch.setattr(fm, "_moe_dot", lambda *a: calls.append("dot") or dot(*a))
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the dot path's Triton kernels
    slots, slot_of, sh = moe_layer(64, 32, 4, dev)
    x, ids = torch.randn(1, 64, device=dev), slot_of[:2][None]
    wts, logit = torch.ones(1, 2, device=dev), torch.ones(1, 1, device=dev)
    assert fm.fuses_shared_expert(x, wts, sh, logit)
    fm.fused_moe(x, ids, wts, slots, shared_slots=sh, shared_logit=logit)
    takes[0] = False
    assert not fm.fuses_shared_expert(x, wts, sh, logit)
    fm.fused_moe(x, ids, wts, slots, shared_slots=sh, shared_logit=logit)
    assert calls == ["cuda", "dot", "dot"]
    monkeypatch.undo()
    assert not nvfp4_cuda.moe_takes(x.cpu(), torch.ones(2), 2, slots, None, None)  # the CPU


@pytest.mark.requires_cuda
def test_moe_decode_graph_dependent_and_repeats(poison, monkeypatch):
    # graph replays == eager, dependent == ordinary launches, bit for bit, at 1 and 8 tokens
    slots, slot_of, sh = moe_layer(2048, 512, 32, "cuda")
    for n in (1, 8):
        ids = torch.stack([slot_of[torch.randperm(32, device="cuda")[:8]] for _ in range(n)])
        wts = torch.softmax(torch.randn(n, 8, device="cuda"), -1).to(torch.bfloat16)
        x = torch.randn(n, 2048, device="cuda", dtype=torch.bfloat16)
        logit = torch.randn(n, 1, device="cuda", dtype=torch.bfloat16)
        args = (x, ids.view(-1), wts.view(-1), 8, slots, sh, logit)
        with monkeypatch.context() as mp:
            mp.setattr(nvfp4_cuda, "dependent_launch", lambda device: False)  # ordinary
            eager = nvfp4_cuda.moe_decode(*args)
        assert torch.equal(nvfp4_cuda.moe_decode(*args), eager)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = nvfp4_cuda.moe_decode(*args)
        for _ in range(3):
            y.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, eager)


@pytest.mark.slow
def test_kernels_build_for_sm90_within_their_occupancy():
    """NVRTC (no GPU needed) builds every NVFP4 kernel for sm_90 without register spills and
    within the registers of its CTAs per SM: the GEMV and the MoE gate_up hold all of their
    weight pieces in registers (2 CTAs of 256 threads: 128; gate_up 3 CTAs: 80)."""
    fmts = ("nvfp4::Bf16", "nvfp4::Fp16")
    gemv = [f"nvfp4::nvfp4_gemv_one_row<{t}, {k // 1024}, {r}>" for t in fmts
            for k in nvfp4_cuda.KS for r in nvfp4_cuda.allowed_rows_per_warp(k)]
    gate_up = [f"nvfp4::moe_gate_up<{t}, {h // 1024}>" for t in fmts for h in nvfp4_cuda.MOE_HS]
    down = [f"nvfp4::moe_down<{t}, {f}, {nvfp4_cuda.MOE_DOWN_ROWS}>" for t in fmts
            for f in nvfp4_cuda.MOE_FS]
    entries = (ptxas_entries(nvfp4_cuda.GEMV, gemv)
               + ptxas_entries(nvfp4_cuda.MOE, gate_up + down))
    assert len(entries) == len(gemv) + len(gate_up) + len(down)
    for entry in entries:
        name = entry.split("'")[1]
        assert not re.search(r"[1-9]\d* bytes spill stores", entry), (name, entry[-500:])
        regs = int(re.search(r"Used (\d+) registers", entry).group(1))
        assert regs <= (80 if "moe_gate_up" in name else 128), (name, regs)
