"""The tensor-core ISO3 decode kernel (csrc/iso_decode_mma.cu) and its launcher
(`iso_mma.iso_decode_attention_mma`), compiled for the CPU under the CUDA emulation
(emulation.py, cuda_emu/emu.h, plus the kernel's own emulation of the byte permute and of the
warp-wide mma.sync with the PTX fragment layouts), against `decode_attention_ref`: GQA groups
1-8, head_dim 128/256, page sizes 1/4/16, mixed lengths, one and many splits, 4 and 16 warps
per CTA (`iso_mma.WARPS`), poisoned partials and outputs. Bound: fp16 operands with fp32
accumulation, |out - ref| <= 3e-3 * max|ref| and cosine >= 0.99999."""

from __future__ import annotations

import math
import re

import pytest
import torch

from tests.kernels import emulation
from tests.kernels.recorder import Recorder
from tests.kernels.sm90_build import ptxas_entries
from tinyserve.kernels import cuda_launch, iso, launch
from tinyserve.kernels.attention import split as decode_split
from tinyserve.kernels.iso import cuda as iso_cuda
from tinyserve.kernels.iso import mma as iso_mma

CSRC = emulation.CSRC


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    return emulation.EmuBackend(tmp_path_factory.mktemp("iso_mma_emu"))


@pytest.fixture
def emu(backend, monkeypatch):
    """The emulated backend, with every split-K partial poisoned before the kernel runs."""
    buffers = decode_split.split_buffers

    def poisoned(q, splits):
        return tuple(t.fill_(float("nan")) for t in buffers(q, splits))

    monkeypatch.setattr(iso_mma, "split_buffers", poisoned)
    with cuda_launch.use_backend(backend):
        yield backend


CASES = [  # hq, hkv, d, page_size, lens, split tokens (None: one split), warps, out dtype,
    # q dtype
    (16, 2, 256, 16, [1], None, 4, torch.float32, torch.float32),
    (16, 2, 256, 16, [70, 17, 300], 64, 4, torch.float32, torch.bfloat16),
    (16, 2, 256, 16, [70, 17, 300], 64, 4, torch.float32, torch.float32),
    (16, 2, 256, 1, [33, 2], 32, 4, torch.bfloat16, torch.bfloat16),
    (8, 8, 128, 16, [5, 100], None, 4, torch.float32, torch.float16),
    (8, 2, 128, 4, [100, 1], 48, 4, torch.float32, torch.float32),
    (2, 1, 256, 4, [129], 80, 4, torch.float32, torch.float32),
    (6, 2, 128, 16, [40], None, 4, torch.float32, torch.float32),
    (16, 2, 256, 16, [600, 5], 16, 4, torch.float32, torch.float32),  # 38 splits
    (8, 1, 256, 16, [1100], 16, 4, torch.float32, torch.bfloat16),  # 69 splits: > 2 rounds
    (16, 2, 256, 16, [1000], None, 4, torch.float32, torch.float32),  # ~16 sub-tiles/warp
    # 16 warps per CTA (warps without a sub-tile merge as empty)
    (16, 2, 256, 16, [70, 17, 300], 64, 16, torch.float32, torch.bfloat16),
    (16, 2, 256, 16, [1000], None, 16, torch.float32, torch.float32),  # ~4 sub-tiles/warp
    (4, 2, 128, 1, [129, 2], 48, 16, torch.bfloat16, torch.bfloat16),
    (6, 2, 128, 16, [40], None, 16, torch.float32, torch.float32),  # 13 of 16 warps idle
    (8, 8, 128, 4, [5, 100], None, 16, torch.float32, torch.float16),  # D=128: 256 q groups
    (16, 2, 256, 4, [600, 5], 128, 16, torch.float32, torch.float32),
    (2, 1, 256, 16, [1], None, 16, torch.float32, torch.float32),
    (8, 1, 256, 16, [1100], 272, 16, torch.float32, torch.bfloat16),  # 5 splits
]


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
    # one unused slot at the end: the 16-byte staging copies read up to the last row's end
    # rounded up to 16 bytes, which a CUDA allocation always holds
    pad = torch.zeros(1, hkv, kc.shape[-1], dtype=torch.uint8)
    return torch.cat([kc, pad]), torch.cat([vc, pad]), table


@pytest.mark.parametrize("case", CASES, ids=[f"hq{c[0]}-hkv{c[1]}-d{c[2]}-ps{c[3]}-"
                                             f"len{max(c[4])}x{len(c[4])}-w{c[6]}-"
                                             f"q{str(c[8])[6:]}" for c in CASES])
def test_mma_decode_matches_reference(emu, case) -> None:
    hq, hkv, d, ps, lens, split_tokens, warps, dtype, q_dtype = case
    gen = torch.Generator().manual_seed(hq * 7 + d + len(lens))
    kc, vc, table = _cache(hkv, d, ps, lens, gen)
    q = (torch.randn(len(lens), hq, d, generator=gen) * 3).to(q_dtype)
    seq = torch.tensor(lens, dtype=torch.int32)
    out = torch.full((len(lens), hq, d), float("nan")).to(dtype)
    assert iso_mma.iso_decode_attention_mma(
        q, kc, vc, table, seq, ps, "iso3", d ** -0.5, max_seq_len=max(lens), out=out,
        split_tokens=split_tokens or max(lens), warps=warps, ctas_per_sm=2) is out
    ref = iso.decode_attention_ref(q.float(), kc, vc, table, seq, ps, "iso3", d ** -0.5)
    assert not out.isnan().any()
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0)
    err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
    tol = 3e-3 if dtype == torch.float32 else 1e-2
    print(f"cosine {cos.item():.7f} relative error {err:.2e}")
    assert cos >= 0.99999 and err < tol, f"cosine {cos}, relative error {err:.2e}"


def test_mma_rejects_unsupported(emu) -> None:
    def call(hq=8, hkv=1, d=256, at=0, **kw):
        rb = iso.packed_row_bytes(d, "iso3")
        kc = torch.zeros(5, hkv, rb, dtype=torch.uint8).view(-1)[at:at + 4 * hkv * rb]
        kc = kc.view(4, hkv, rb)
        q = torch.zeros(1, hq, d)
        table, seq = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
        return iso_mma.iso_decode_attention_mma(q, kc, kc, table, seq, 4, "iso3", 1.0,
                                                max_seq_len=1, **kw)

    assert not call().isnan().any()
    # 16-byte copies: an unaligned cache or a slot stride of half words is refused
    for bad in (dict(hq=16), dict(d=384), dict(warps=3), dict(warps=8), dict(warps=32),
                dict(at=4), dict(hq=2, hkv=1, d=128)):
        with pytest.raises(ValueError):
            call(**bad)


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
    for batch, ctx, ctas in [(1, 32768, 3), (8, 32768, 7), (8, 131072, 7), (1, 4096, 3),
                             (3, 100000, 5), (64, 32768, 7)]:
        chunk, splits = decode_split.plan_splits(batch, 2, ctx, 132, min_tokens=64,
                                                 ctas_per_sm=ctas, tile=16, one_wave=True)
        assert splits * batch * 2 <= max(ctas * 132, batch * 2)
        assert chunk % 16 == 0 and (splits - 1) * chunk < ctx <= splits * chunk
    # batch 1, 32k, 3 CTAs of 4 warps per SM: 187 splits of 176 tokens = 374 of 396 slots
    assert decode_split.plan_splits(1, 2, 32768, 132, min_tokens=64, ctas_per_sm=3, tile=16,
                                    one_wave=True) == (176, 187)
    assert decode_split.plan_splits(8, 2, 32768, 132, min_tokens=128, ctas_per_sm=7, tile=16,
                                    one_wave=True) == (576, 57)


def test_decode_launchers_check_devices_and_out() -> None:
    # q, page_table, seq_lens and out must be on the caches' device and out of a float dtype:
    # the kernels take raw pointers
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
    for case in bad:
        args = {"q": q, "table": table, "seq": seq, "out": None, **case}
        with pytest.raises(ValueError):
            iso_mma.iso_decode_attention_mma(args["q"], kc, kc, args["table"], args["seq"], ps,
                                             "iso3", 1.0, max_seq_len=8, out=args["out"])


def test_every_cuda_source_has_a_launcher() -> None:
    # every .cu file is compiled by a launcher module, every header included by a .cu file;
    # the build cache hashes every file of csrc/ (a header change rebuilds every kernel)
    from tinyserve.kernels.nvfp4 import cuda as nvfp4_cuda

    sources = {iso_cuda.STORE, iso_mma.SOURCE, nvfp4_cuda.GEMV, nvfp4_cuda.MOE}
    assert {p.name for p in CSRC.glob("*.cu")} == sources
    included = set()
    for p in CSRC.iterdir():
        included |= set(re.findall(r'#include "([\w.]+)"', p.read_text()))
    assert {p.name for p in CSRC.glob("*.cuh")} == included - {"emu.h"}


@pytest.mark.slow
def test_mma_kernel_builds_for_sm90() -> None:
    """NVRTC builds every instance of the kernel for sm_90 without register spills, within
    the register budget of 8 warps per SM (16-warp CTAs: 128 registers) and the 48 KB of
    static shared memory."""
    names = [f"iso::mma::decode_mma_kernel<{nb}, {w}>" for nb in (1, 2) for w in iso_mma.WARPS]
    entries = ptxas_entries(iso_mma.SOURCE, names, 90)
    assert len(entries) == 4
    for entry in entries:
        assert not re.search(r"[1-9]\d* bytes spill stores", entry), entry
        for smem in re.findall(r"(\d+) bytes smem", entry):  # static (8/16 warps: + dynamic)
            assert int(smem) <= 48 * 1024
        warps = int(re.search(r"decode_mma_kernelILi\d+ELi(\d+)E", entry).group(1))
        regs = int(re.search(r"Used (\d+) registers", entry).group(1))
        assert regs <= 65536 // (32 * max(8, warps)), (warps, regs)


@pytest.mark.parametrize("forced", [None, 40])
def test_decode_launcher_passes_the_split_plan(forced) -> None:
    # The launcher launches a (splits, kv heads, batch) grid over the planned (or forced)
    # split with fp32 partials, then the split merge into `out`.
    rec = Recorder()
    b, hq, hkv, d, ps = 2, 8, 2, 256, 16
    rb = iso.packed_row_bytes(d, "iso3")
    kc = torch.zeros(64, hkv, rb, dtype=torch.uint8)
    q = torch.randn(b, hq, d, dtype=torch.bfloat16)
    table = torch.zeros(b, 32, dtype=torch.int32)
    seq = torch.tensor([500, 370], dtype=torch.int32)
    with cuda_launch.use_backend(rec):
        out = iso_mma.iso_decode_attention_mma(q, kc, kc, table, seq, ps, "iso3", 0.5,
                                               split_tokens=forced)
        mma, mma_merge = rec.launches
        # batch 2's row: one wave (2 CTAs per SM, the fallback occupancy off a CUDA device),
        # at least 256 tokens per split: 2 splits of 256 (forced: in 16-token slices)
        want = (256, 2) if forced is None else (48, 11)
        warps = iso_mma.mma_config(b)["warps"]
        assert mma["name"] == f"iso::mma::decode_mma_kernel<2, {warps}>"
        assert mma["grid"] == (want[1], hkv, b) and mma["block"] == 32 * warps
        assert mma["args"][12:14] == list(want) and mma["args"][1] == 1  # q read as bf16
        assert mma["args"][7] == table.shape[1] and not mma["pdl"]  # not a CUDA device
        assert mma_merge["name"] == "iso::decode_merge_cols_kernel<ts::bf16, 1>"
        assert mma_merge["grid"] == (hq, b, d // iso_mma.MERGE_COLS)
        assert mma_merge["args"][-2:] == [out.data_ptr(), out.stride(0)]
        for w in iso_mma.WARPS:  # the warps argument picks the kernel
            iso_mma.iso_decode_attention_mma(q, kc, kc, table, seq, ps, "iso3", 0.5,
                                             split_tokens=forced, warps=w)
            assert rec.launches[-2]["name"] == f"iso::mma::decode_mma_kernel<2, {w}>"
        # one sequence below 96k tokens: the row's 2 CTAs per SM, capped by padding the
        # dynamic shared memory (the recorder's kernels need none); from 96k one full wave
        for bound, smem in ((500, rec.smem_per_sm // 3 - rec.reserved_smem_per_block + 1),
                            (1 << 17, 0)):
            iso_mma.iso_decode_attention_mma(q[:1], kc, kc, table[:1], seq[:1], ps, "iso3",
                                             0.5, max_seq_len=bound)
            assert rec.launches[-2]["smem"] == smem
    assert out.shape == (b, hq, d) and out.dtype == q.dtype


def test_dependent_launches_on_sm90_only(monkeypatch) -> None:
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("TINYSERVE_CUDA_ARCH", raising=False)
    for cap, want in (((9, 0), True), ((10, 0), True), ((8, 9), False), ((8, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev, cap=cap: cap)
        assert launch.dependent_launch(cuda) == want
    # an older GPU's paths on this one: no dependent launches below sm_90
    monkeypatch.setenv("TINYSERVE_CUDA_ARCH", "sm_86")
    assert not launch.dependent_launch(cuda)
    monkeypatch.setenv("TINYSERVE_CUDA_ARCH", "junk")
    with pytest.raises(ValueError, match="TINYSERVE_CUDA_ARCH"):
        launch.dependent_launch(cuda)
    monkeypatch.delenv("TINYSERVE_CUDA_ARCH")
    assert not launch.dependent_launch(torch.device("cpu"))
