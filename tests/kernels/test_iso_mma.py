"""The tensor-core ISO3 decode kernel (csrc/iso_decode_mma.cu) compiled for the CPU under the
CUDA emulation (cuda_emu/emu.h, plus the kernel's own emulation of the byte permute and of
the warp-wide mma.sync with the PTX fragment layouts, -DTINYSERVE_CUDA_EMU), against
`decode_attention_ref`: GQA groups 1-8, head_dim 128/256, page sizes 1/4/16, mixed lengths,
one and many splits, 2, 4, 8 and 16 warps per CTA, every row staging (`iso_mma.LOOPS`: words,
16-byte chunks, 16-byte chunks in padded rows), poisoned partials and outputs. Bound: fp16 operands
with fp32 accumulation, |out - ref| <= 3e-3 * max|ref| and cosine >= 0.99999."""

from __future__ import annotations

import ctypes
import math
import re
import shutil
import subprocess

import pytest
import torch

from tests.kernels import emulation
from tinyserve.kernels import iso, iso_mma

CSRC = emulation.CSRC
I, I64, F, P = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib = emulation.build(("iso_decode_mma.cu",), tmp_path_factory.mktemp("iso_mma_emu"),
                          defines=("TINYSERVE_CUDA_EMU",))
    lib.tinyserve_iso_decode_mma.argtypes = [P, P, P, I64, P, I64, P, I, I, I, I, I, I, I, F,
                                             I, P, P, P, I64, I, I, I, I, I, I, P]
    return lib


CASES = [  # hq, hkv, d, page_size, lens, split tokens (None: one split), warps, out dtype,
    # q dtype
    (16, 2, 256, 16, [1], None, 4, torch.float32, torch.float32),
    (16, 2, 256, 16, [70, 17, 300], 64, 4, torch.float32, torch.bfloat16),
    (16, 2, 256, 16, [70, 17, 300], 64, 4, torch.float32, torch.float32),
    (16, 2, 256, 1, [33, 2], 32, 2, torch.bfloat16, torch.bfloat16),
    (8, 8, 128, 16, [5, 100], None, 2, torch.float32, torch.float16),
    (4, 1, 128, 4, [100, 1], 48, 4, torch.float32, torch.float32),
    (2, 1, 256, 4, [129], 80, 4, torch.float32, torch.float32),
    (6, 2, 128, 16, [40], None, 4, torch.float32, torch.float32),
    (16, 2, 256, 16, [600, 5], 16, 2, torch.float32, torch.float32),  # 38 splits
    (8, 1, 256, 16, [1100], 16, 4, torch.float32, torch.bfloat16),  # 69 splits: > 2 rounds
    (16, 2, 256, 16, [1000], None, 4, torch.float32, torch.float32),  # ~16 sub-tiles/warp
    # 8 and 16 warps per CTA (dynamic shared memory; warps without a sub-tile merge as empty)
    (16, 2, 256, 16, [70, 17, 300], 64, 8, torch.float32, torch.bfloat16),
    (16, 2, 256, 16, [1000], None, 8, torch.float32, torch.float32),  # ~8 sub-tiles/warp
    (4, 1, 128, 1, [129, 2], 48, 8, torch.bfloat16, torch.bfloat16),
    (6, 2, 128, 16, [40], None, 8, torch.float32, torch.float32),  # 5 of 8 warps idle
    (8, 8, 128, 4, [5, 100], None, 16, torch.float32, torch.float16),  # D=128: 256 q groups
    (16, 2, 256, 4, [600, 5], 128, 16, torch.float32, torch.float32),
    (2, 1, 256, 16, [1], None, 16, torch.float32, torch.float32),
    (8, 1, 256, 16, [1100], 272, 16, torch.float32, torch.bfloat16),  # 5 splits
]
_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _cache(hkv, d, ps, lens, gen):
    pages_per = [math.ceil(n / ps) for n in lens]
    num_pages = sum(pages_per) + 1
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(lens), max(pages_per) + 1, dtype=torch.int32)
    table[:, -1] = 1 << 20  # no row read there: past every sequence's pages
    at = 0
    for b, p in enumerate(pages_per):
        table[b, :p] = perm[at:at + p].int()
        at += p
    k = torch.randn(num_pages * ps, hkv, d, generator=gen)
    k[:, :, 5] *= 8  # an outlier channel
    kc = iso.quantize_ref(k, "iso3")
    vc = iso.quantize_ref(torch.randn(num_pages * ps, hkv, d, generator=gen), "iso3")
    # one unused slot at the end: the 16-byte staging copies ("tokens_wide") read up to the
    # last row's end rounded up to 16 bytes, which a CUDA allocation always holds
    pad = torch.zeros(1, hkv, kc.shape[-1], dtype=torch.uint8)
    return torch.cat([kc, pad]), torch.cat([vc, pad]), table


@pytest.mark.parametrize("loop", iso_mma.LOOPS)
@pytest.mark.parametrize("case", CASES, ids=[f"hq{c[0]}-hkv{c[1]}-d{c[2]}-ps{c[3]}-"
                                             f"len{max(c[4])}x{len(c[4])}-w{c[6]}-"
                                             f"q{str(c[8])[6:]}" for c in CASES])
def test_mma_decode_matches_reference(lib, case, loop) -> None:
    hq, hkv, d, ps, lens, split_tokens, warps, dtype, q_dtype = case
    gen = torch.Generator().manual_seed(hq * 7 + d + len(lens))
    kc, vc, table = _cache(hkv, d, ps, lens, gen)
    q = (torch.randn(len(lens), hq, d, generator=gen) * 3).to(q_dtype)
    seq = torch.tensor(lens, dtype=torch.int32)
    chunk = split_tokens or max(lens)
    splits = math.ceil(max(lens) / chunk)
    part_acc = torch.full((len(lens), hq, splits, d), float("nan"))
    part_ml = torch.full((len(lens), hq, splits, 2), float("nan"))
    out = torch.full((len(lens), hq, d), float("nan")).to(dtype)
    rc = lib.tinyserve_iso_decode_mma(
        q.data_ptr(), kc.data_ptr(), vc.data_ptr(), kc.stride(0), table.data_ptr(),
        table.stride(0), seq.data_ptr(), len(lens), hq, hkv, d, ps, chunk, splits, d ** -0.5,
        warps, part_acc.data_ptr(), part_ml.data_ptr(), out.data_ptr(), out.stride(0),
        _CODE[dtype], _CODE[q_dtype], iso_mma._wide(loop), 1, 2, table.shape[1], None)
    assert rc == 0
    ref = iso.decode_attention_ref(q.float(), kc, vc, table, seq, ps, "iso3", d ** -0.5)
    assert not out.isnan().any()
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0)
    err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
    tol = 3e-3 if dtype == torch.float32 else 1e-2
    print(f"cosine {cos.item():.7f} relative error {err:.2e}")
    assert cos >= 0.99999 and err < tol, f"cosine {cos}, relative error {err:.2e}"


@pytest.mark.parametrize("case", [CASES[2], CASES[3], CASES[7], CASES[12], CASES[15]],
                         ids=lambda c: f"d{c[2]}-ps{c[3]}-w{c[6]}")
def test_mma_padded_rows_give_the_same_bits(lib, case) -> None:
    # "tokens_pad" changes only where the staged rows sit in shared memory, not the arithmetic
    hq, hkv, d, ps, lens, split_tokens, warps, dtype, q_dtype = case
    gen = torch.Generator().manual_seed(11 * hq + d)
    kc, vc, table = _cache(hkv, d, ps, lens, gen)
    # the 16-byte staging runs (not its word fallback)
    assert kc.data_ptr() % 16 == vc.data_ptr() % 16 == 0 and kc.stride(0) % 4 == 0
    q = (torch.randn(len(lens), hq, d, generator=gen) * 3).to(q_dtype)
    seq = torch.tensor(lens, dtype=torch.int32)
    chunk = split_tokens or max(lens)
    splits = math.ceil(max(lens) / chunk)
    outs = []
    for loop in ("tokens_wide", "tokens_pad"):
        part_acc = torch.full((len(lens), hq, splits, d), float("nan"))
        part_ml = torch.full((len(lens), hq, splits, 2), float("nan"))
        out = torch.full((len(lens), hq, d), float("nan")).to(dtype)
        assert lib.tinyserve_iso_decode_mma(
            q.data_ptr(), kc.data_ptr(), vc.data_ptr(), kc.stride(0), table.data_ptr(),
            table.stride(0), seq.data_ptr(), len(lens), hq, hkv, d, ps, chunk, splits,
            d ** -0.5, warps, part_acc.data_ptr(), part_ml.data_ptr(), out.data_ptr(),
            out.stride(0), _CODE[dtype], _CODE[q_dtype], iso_mma._wide(loop), 1, 0,
            table.shape[1], None) == 0
        assert not out.isnan().any()
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_mma_rejects_unsupported(lib) -> None:
    z = torch.zeros(4, dtype=torch.int32)
    args = [z.data_ptr(), z.data_ptr(), z.data_ptr(), 0, z.data_ptr(), 1, z.data_ptr(), 1]
    tail = [16, 1, 1, 1.0, 4, z.data_ptr(), z.data_ptr(), z.data_ptr(), 0, 0, 0, 1, 0, 0, 1,
            None]
    assert lib.tinyserve_iso_decode_mma(*args, 16, 1, 256, *tail) == 3  # group 16
    assert lib.tinyserve_iso_decode_mma(*args, 8, 1, 384, *tail) == 2  # head_dim
    for warps in (3, 6, 32):
        bad_warps = tail[:4] + [warps] + tail[5:]
        assert lib.tinyserve_iso_decode_mma(*args, 8, 1, 256, *bad_warps) == 4
    # q dtype code, wide, pdl, CTA cap, page-table columns (at most the row stride, 1 here)
    for bad in ([0, 3, 1, 0, 0, 1], [0, -1, 1, 0, 0, 1], [0, 0, 3, 0, 0, 1],
                [0, 0, -1, 0, 0, 1], [0, 0, 1, 2, 0, 1], [0, 0, 1, -1, 0, 1],
                [0, 0, 1, 0, -1, 1], [0, 0, 1, 0, 0, -1], [0, 0, 1, 0, 0, 2]):
        assert lib.tinyserve_iso_decode_mma(*args, 8, 1, 256, *tail[:-7], *bad, None) == 5


def test_mma_occupancy_entry(lib) -> None:
    # the emulation reports 2 CTAs per SM for every kernel that exists, 0 for the others
    for d in (128, 256):
        for warps in iso_mma.WARPS:
            for wide in (0, 1, 2):
                assert lib.tinyserve_iso_decode_mma_occupancy(d, warps, wide) == 2
    for bad in ((384, 4, 1), (256, 3, 1), (256, 32, 0), (256, 8, 3), (128, 4, -1)):
        assert lib.tinyserve_iso_decode_mma_occupancy(*bad) == 0


def test_mma_config_table() -> None:
    # batch 1 takes a full wave of CTAs from 96k tokens, 2 CTAs per SM below; batch > 1 the
    # last row at any length
    long_b1, short_b1, many = iso_mma.MMA_CONFIG
    assert iso_mma.mma_config(1) is short_b1 and iso_mma.mma_config(1, 98303) is short_b1
    assert iso_mma.mma_config(1, 98304) is long_b1 and long_b1["ctas_per_sm"] is None
    assert iso_mma.mma_config(2, 1 << 17) is many
    assert iso_mma.mma_config(10 ** 9) is iso_mma.MMA_CONFIG[-1]
    for row in iso_mma.MMA_CONFIG:
        assert row["warps"] in iso_mma.WARPS and (row["ctas_per_sm"] or 0) >= 0
    assert iso_mma.mma_supported("iso3", 16, 2, 256)
    assert not iso_mma.mma_supported("iso4", 16, 2, 256)
    assert not iso_mma.mma_supported("iso3", 32, 2, 256)


def test_plan_splits_one_wave() -> None:
    # one wave: never more CTAs than ctas_per_sm x SMs (floor), unlike the CTA target (ceil)
    from tinyserve.kernels import iso_cuda

    for batch, ctx, ctas in [(1, 32768, 3), (8, 32768, 7), (8, 131072, 7), (1, 4096, 3),
                             (3, 100000, 5), (64, 32768, 7)]:
        chunk, splits = iso_cuda.plan_splits(batch, 2, ctx, 132, min_tokens=64,
                                             ctas_per_sm=ctas, tile=16, one_wave=True)
        assert splits * batch * 2 <= max(ctas * 132, batch * 2)
        assert chunk % 16 == 0 and (splits - 1) * chunk < ctx <= splits * chunk
    # batch 1, 32k, 3 CTAs of 4 warps per SM: 187 splits of 176 tokens = 374 of 396 slots
    assert iso_cuda.plan_splits(1, 2, 32768, 132, min_tokens=64, ctas_per_sm=3, tile=16,
                                one_wave=True) == (176, 187)
    assert iso_cuda.plan_splits(8, 2, 32768, 132, min_tokens=128, ctas_per_sm=7, tile=16,
                                one_wave=True) == (576, 57)


def test_decode_launchers_check_devices_and_out(monkeypatch) -> None:
    # q, page_table, seq_lens and out must be on the caches' device and out of a float dtype:
    # the kernels take raw pointers. The caches' CUDA check is lifted to run on the CPU.
    from tinyserve.kernels import iso_cuda

    monkeypatch.setattr(iso_cuda, "_check_cache", lambda *a: None)
    b, hq, hkv, d, ps = 2, 4, 2, 128, 4
    rb = iso.packed_row_bytes(d, "iso3")
    kc = torch.zeros(8, hkv, rb, dtype=torch.uint8)
    q = torch.randn(b, hq, d)
    table = torch.zeros(b, 2, dtype=torch.int32)
    seq = torch.full((b,), 5, dtype=torch.int32)
    meta = {"device": "meta"}
    bad = [dict(q=q.to(**meta)), dict(table=table.to(**meta)), dict(seq=seq.to(**meta)),
           dict(out=torch.empty(b, hq, d, **meta)),
           dict(out=torch.empty(b, hq, d, dtype=torch.int32))]
    for launch in (iso_cuda.iso_decode_attention, iso_mma.iso_decode_attention_mma):
        for case in bad:
            args = {"q": q, "table": table, "seq": seq, "out": None, **case}
            with pytest.raises(ValueError):
                launch(args["q"], kc, kc, args["table"], args["seq"], ps, "iso3", 1.0,
                       max_seq_len=8, out=args["out"])


def test_every_cuda_source_is_in_a_build_hash() -> None:
    # a change to any csrc file must rebuild its library (cuda_build.library hashes these)
    from tinyserve.kernels import iso_cuda, nvfp4_cuda

    assert {p.name for p in CSRC.glob("*.cu")} == {*iso_cuda._SOURCES, *nvfp4_cuda._SOURCES}
    assert {p.name for p in CSRC.glob("*.cuh")} == {*iso_cuda._HEADERS, *nvfp4_cuda._HEADERS}


@pytest.mark.slow
def test_mma_kernel_builds_for_sm90(tmp_path) -> None:
    """nvcc (no GPU needed) builds the kernel for sm_90 without register spills, within
    the register budget of 8 warps per SM (16-warp CTAs: 128 registers) and the 48 KB of
    static shared memory."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc")
    res = subprocess.run([nvcc, "-std=c++17", "-O3", "-arch=sm_90", "-c", "-Xptxas", "-v",
                          "-I", str(CSRC), "-o", str(tmp_path / "mma.o"),
                          str(CSRC / "iso_decode_mma.cu")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    info = res.stderr
    kernels = re.findall(r"Compiling entry function '(\w*decode_mma_kernel\w*)'", info)
    # head_dim 128/256 x 2/4/8/16 warps x 3 stagings (words, 16-byte, 16-byte padded rows)
    assert len(kernels) == 24, info[-3000:]
    assert not re.search(r"[1-9]\d* bytes spill stores", info), info[-3000:]
    for smem in re.findall(r"(\d+) bytes smem", info):  # static (8/16 warps: + dynamic)
        assert int(smem) <= 48 * 1024
    # per kernel (ptxas's report of one entry): its warps per CTA, the mangled name's second
    # template argument, and its registers
    entries = [e for e in info.split("Compiling entry function") if "decode_mma_kernel" in e]
    for entry in entries:
        warps = int(re.search(r"decode_mma_kernelILi\d+ELi(\d+)E", entry).group(1))
        regs = int(re.search(r"Used (\d+) registers", entry).group(1))
        assert regs <= 65536 // (32 * max(8, warps)), (warps, regs)


@pytest.mark.parametrize("forced", [None, 40])
def test_decode_launchers_pass_the_split_plan_to_the_library(monkeypatch, forced) -> None:
    # Both CUDA decode launchers hand the C entry the same argument list: the planned (or
    # forced) split, fp32 partials, the variant argument (bits / warps) and the out pointer.
    from tinyserve.kernels import iso_cuda

    calls = []
    monkeypatch.setattr(iso_cuda, "_check_cache", lambda *a: None)
    monkeypatch.setattr(iso_cuda, "_call", lambda dev, name, *a: calls.append((name, a)))
    props = type("P", (), {"multi_processor_count": 132})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: props)
    b, hq, hkv, d, ps = 2, 8, 2, 256, 16
    rb = iso.packed_row_bytes(d, "iso3")
    kc = torch.zeros(64, hkv, rb, dtype=torch.uint8)
    q = torch.randn(b, hq, d, dtype=torch.bfloat16)
    table = torch.zeros(b, 32, dtype=torch.int32)
    seq = torch.tensor([500, 370], dtype=torch.int32)
    out_cuda = iso_cuda.iso_decode_attention(q, kc, kc, table, seq, ps, "iso3", 0.5,
                                             split_tokens=forced)
    out_mma = iso_mma.iso_decode_attention_mma(q, kc, kc, table, seq, ps, "iso3", 0.5,
                                               split_tokens=forced)
    (n1, a1), (n2, a2) = calls[:2]
    assert (n1, n2) == ("tinyserve_iso_decode", "tinyserve_iso_decode_mma")
    want_cuda = (256, 2) if forced is None else (64, 8)  # 32-token tiles
    # planned on the CPU: 4 SMs (decode_splits), 2 CTAs per SM (no occupancy): one wave of
    # 8 CTAs = 2 splits per (sequence, kv head)
    want_mma = (256, 2) if forced is None else (48, 11)  # forced splits in 16-token slices
    assert a1[7:16] == (b, hq, hkv, d, ps, *want_cuda, 0.5, 3)
    assert a2[7:16] == (b, hq, hkv, d, ps, *want_mma, 0.5, iso_mma.mma_config(b)["warps"])
    assert a1[3] == kc.stride(0) and a1[5] == table.stride(0)
    assert a1[-3:] == (out_cuda.data_ptr(), out_cuda.stride(0), 1)
    # the MMA entry reads q in its dtype (code 1: bf16) and takes the default loop's `wide`
    default_wide = iso_mma._WIDE_CODE[iso_mma.MMA_LOOP]
    # and pdl 0 (not a CUDA device), then the cap of CTAs per SM (0: batch 2's row fills one
    # wave by occupancy) and the page table's columns
    assert a2[-8:] == (out_mma.data_ptr(), out_mma.stride(0), 1, 1, default_wide, 0, 0,
                       table.shape[1])
    assert a2[0] == q.data_ptr()
    for name, wide in (("tokens", 0), ("tokens_wide", 1), ("tokens_pad", 2)):
        iso_mma.iso_decode_attention_mma(q, kc, kc, table, seq, ps, "iso3", 0.5,
                                         split_tokens=forced, loop=name)
        assert calls[-1][1][7:16] == a2[7:16] and calls[-1][1][-4] == wide
    for bad in ("heads", "x"):
        with pytest.raises(ValueError):
            iso_mma.iso_decode_attention_mma(q, kc, kc, table, seq, ps, "iso3", 0.5, loop=bad)
    for warps in iso_mma.WARPS:  # the warps argument reaches the entry as its variant
        iso_mma.iso_decode_attention_mma(q, kc, kc, table, seq, ps, "iso3", 0.5,
                                         split_tokens=forced, warps=warps)
        assert calls[-1][1][7:15] == a2[7:15] and calls[-1][1][15] == warps
    with pytest.raises(ValueError):
        iso_mma.iso_decode_attention_mma(q, kc, kc, table, seq, ps, "iso3", 0.5, warps=6)
    # one sequence below 96k tokens: the row's 2 CTAs per SM, capped; from 96k one full wave
    for bound, cap in ((500, 2), (1 << 17, 0)):
        iso_mma.iso_decode_attention_mma(q[:1], kc, kc, table[:1], seq[:1], ps, "iso3", 0.5,
                                         max_seq_len=bound)
        assert calls[-1][1][-2] == cap
    assert out_cuda.shape == out_mma.shape == (b, hq, d) and out_cuda.dtype == q.dtype


def test_dependent_launches_on_sm90_only(monkeypatch) -> None:
    cuda = torch.device("cuda", 0)
    for cap, want in (((9, 0), 1), ((10, 0), 1), ((8, 9), 0), ((8, 0), 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev, cap=cap: cap)
        assert iso_mma._pdl(cuda, None) == want
        assert iso_mma._pdl(cuda, True) == want
        assert iso_mma._pdl(cuda, False) == 0
    monkeypatch.setattr(iso_mma, "DEPENDENT_LAUNCHES", False)
    assert iso_mma._pdl(cuda, None) == 0
    assert iso_mma._pdl(torch.device("cpu"), True) == 0
