"""The paged bf16/fp16 KV kernels (kernels/attention/paged_triton.py) against their torch references
(kernels/attention/paged_ref.py) and an fp32 attention oracle over exactly each sequence's tokens.

Without CUDA the kernels run in the Triton interpreter at small sizes; with one the GPU suite
adds the 35B-A3B shapes (16 query heads, 2 kv heads, head_dim 256) at long contexts. Every
cache slot a sequence does not own is NaN (stale pages, the tail of a sequence's last page),
page-table columns past the graph bound hold page ids far outside the cache, outputs and
split partials start as NaN (`poison`). Decode bound: |out - oracle| <= 1e-2 * max|oracle|
(P rounded to the cache dtype, as flash attention does). The store compares exactly.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tests.kernels.test_norm import interpreter_ok, run_in_interpreter_child  # noqa: F401
from tinyserve.kernels.attention import paged_ref as paged_kv
from tinyserve.kernels.iso.ref import attention_oracle

pytest.importorskip("triton")
from tinyserve.kernels.attention import paged_triton as pk

pytestmark = [pytest.mark.usefixtures("poison"), pytest.mark.gpu_shapes]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
FAR_PAGE = 10_000_000  # a page id no cache has: reading it faults or fails

# name: (lens, hq, hkv, d, page_size, split_tokens (None: planned), bound = max_seq_len)
SMALL = {
    "35b-len1,70-ps16-split32": ([1, 70], 16, 2, 256, 16, 32, 128),
    "g4-d128-ps4-planned": ([5, 100, 33], 8, 2, 128, 4, None, 128),
    "g16-d64-ps1-split16": ([37], 16, 1, 64, 1, 16, 64),
    "g1-d32-ps8-bound-x4": ([9, 1], 2, 2, 32, 8, 16, 64),
    "g3-d16-ps3-split16": ([7, 20, 16], 6, 2, 16, 3, 16, 32),
}
LARGE = {  # the model's shapes, GPU only
    "35b-b1-32k": ([32768 - 5], 16, 2, 256, 16, None, 32768),
    "35b-b1-1k-bound2k": ([1093], 16, 2, 256, 16, None, 2048),
    "35b-b8-mixed": ([1, 17, 1000, 4097, 300, 8191, 2, 5000], 16, 2, 256, 16, None, 8192),
    "35b-b2-128k": ([131072, 65537], 16, 2, 256, 16, None, 131072),
    "g16-d128-b4": ([3, 900, 2049, 40], 32, 2, 128, 16, None, 4096),
    "g8-d128-ps64-split96": ([500, 129], 16, 2, 128, 64, 96, 512),
}
CASES = SMALL if DEV == "cpu" else {**SMALL, **LARGE}


@pytest.fixture(autouse=True)
def _interpreter(request):
    """`interpreter_ok` for the kernel tests (the slow build test compiles instead)."""
    if request.node.get_closest_marker("slow") is None:
        request.getfixturevalue("interpreter_ok")


def test_kernels_in_interpreter_child() -> None:
    run_in_interpreter_child(__file__)


def _paged(lens, hkv, d, ps, bound, dtype, seed):
    """On DEV: (k_cache, v_cache [slots, Hkv, D] NaN outside the sequences, page table [B, P]
    int32, seq_lens [B] int32, per sequence its K, V [T, Hkv, D])."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    n_pages = [math.ceil(n / ps) for n in lens]
    bound_pages = math.ceil(bound / ps)
    stale = 2  # pages nobody owns (NaN): the table's columns past a sequence's pages
    total = sum(n_pages) + stale + 1
    perm = torch.randperm(total, generator=gen, device=DEV).int()
    table = torch.full((len(lens), bound_pages + 2), FAR_PAGE, dtype=torch.int32, device=DEV)
    kc = torch.full((total * ps, hkv, d), float("nan"), dtype=dtype, device=DEV)
    vc = torch.full_like(kc, float("nan"))
    seqs, at = [], stale
    for b, (n, p) in enumerate(zip(lens, n_pages, strict=True)):
        table[b, :bound_pages] = perm[torch.arange(bound_pages, device=DEV) % stale]
        table[b, :p] = perm[at:at + p]
        at += p
        k = torch.randn(n, hkv, d, generator=gen, device=DEV).to(dtype)
        v = torch.randn(n, hkv, d, generator=gen, device=DEV).to(dtype)
        k[:, :, 1] *= 8  # an outlier channel
        t = torch.arange(n, device=DEV)
        slots = table[b].long()[t // ps] * ps + t % ps
        kc[slots], vc[slots] = k, v
        seqs.append((k, v))
    return kc, vc, table, torch.tensor(lens, dtype=torch.int32, device=DEV), seqs


def _oracle(q, seqs, scale):
    """fp32 [B, Hq, D] on the CPU: attention of q [B, Hq, D] over each sequence's K/V."""
    return torch.stack([attention_oracle(q[b:b + 1].float(), k.float(), v.float(), len(k) - 1,
                                         scale)[0].cpu() for b, (k, v) in enumerate(seqs)])


def _rel(got, want) -> float:
    return ((got.float().cpu() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_decode_matches_oracle_and_reference(name: str, dtype: torch.dtype) -> None:
    lens, hq, hkv, d, ps, split, bound = CASES[name]
    if DEV == "cpu" and dtype == torch.float16 and d > 64:
        pytest.skip("fp16 at small head_dim only on the CPU (interpreter time)")
    kc, vc, table, seq_lens, seqs = _paged(lens, hkv, d, ps, bound, dtype, seed=sum(lens) + d)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(hq))
    q = q.to(DEV, dtype)
    scale = d ** -0.5
    out = torch.full((len(lens), hq, d), float("nan"), dtype=dtype, device=DEV)
    got = pk.paged_decode_attention(q, kc, vc, table, seq_lens, ps, scale, max_seq_len=bound,
                                    out=out, split_tokens=split)
    assert got is out and got.dtype == dtype and not got.isnan().any()
    want = _oracle(q, seqs, scale)
    assert _rel(got, want) < 1e-2, f"kernel vs oracle {_rel(got, want):.2e}"
    if sum(lens) * hkv * d <= 1 << 22:  # the reference gathers bound pages per row
        ref = paged_kv.paged_decode_ref(q, kc, vc, table, seq_lens, ps, scale,
                                        max_seq_len=bound)
        assert _rel(ref, want) < 1e-2, f"reference vs oracle {_rel(ref, want):.2e}"


def test_decode_fp32_query_over_bf16_cache() -> None:
    """q in fp32 (cast to the cache dtype inside), output in fp32."""
    lens, hq, hkv, d, ps, split, bound = SMALL["g16-d64-ps1-split16"]
    kc, vc, table, seq_lens, seqs = _paged(lens, hkv, d, ps, bound, torch.bfloat16, seed=3)
    q = torch.randn(len(lens), hq, d, device=DEV)
    got = pk.paged_decode_attention(q, kc, vc, table, seq_lens, ps, d ** -0.5,
                                    max_seq_len=bound)
    assert got.dtype == torch.float32
    assert _rel(got, _oracle(q.bfloat16(), seqs, d ** -0.5)) < 1e-2


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float32], ids=str)
def test_store_matches_reference(src: torch.dtype) -> None:
    """Rows land at their slots, negative slots at the padding slot, nothing else written;
    k and v are row-strided views of one projection (as a decode step hands them over)."""
    n, hkv, d, pad = 7, 2, 64, 40
    qkv = torch.randn(n, 3 * hkv * d + 5, generator=torch.Generator().manual_seed(n)).to(src)
    k = qkv[:, 5:5 + hkv * d].view(n, hkv, d)
    v = qkv[:, 5 + hkv * d:5 + 2 * hkv * d].view(n, hkv, d)
    slots = torch.tensor([3, -1, 17, 5, 39, 0, 22])
    kc = torch.full((pad + 1, hkv, d), float("nan"), dtype=torch.bfloat16)
    vc = kc.clone()
    got_k, got_v = kc.to(DEV), vc.to(DEV)
    pk.paged_store(got_k, got_v, slots.to(DEV), k.to(DEV), v.to(DEV), pad)
    paged_kv.paged_store_ref(kc, vc, slots, k, v, pad)
    if src == torch.bfloat16 or DEV == "cuda":
        assert torch.equal(got_k.cpu().nan_to_num(7.0), kc.nan_to_num(7.0))
        assert torch.equal(got_v.cpu().nan_to_num(7.0), vc.nan_to_num(7.0))
    else:  # the interpreter truncates fp32 -> bf16: one rounding step
        torch.testing.assert_close(got_k.cpu().float(), kc.float(), rtol=2 ** -7, atol=0,
                                   equal_nan=True)
        torch.testing.assert_close(got_v.cpu().float(), vc.float(), rtol=2 ** -7, atol=0,
                                   equal_nan=True)
    written = torch.zeros(pad + 1, dtype=torch.bool)
    written[[3, 17, 5, 39, 0, 22, pad]] = True
    assert got_k[~written.to(DEV)].isnan().all() and not got_k[written.to(DEV)].isnan().any()


def test_decode_supported_shapes() -> None:
    assert pk.decode_supported(16, 2, 256, torch.bfloat16)
    assert pk.decode_supported(32, 2, 128, torch.float16)
    assert not pk.decode_supported(34, 2, 128, torch.bfloat16)  # group 17
    assert not pk.decode_supported(16, 2, 96, torch.bfloat16)
    assert not pk.decode_supported(16, 2, 512, torch.bfloat16)
    assert not pk.decode_supported(16, 2, 256, torch.float32)


def test_rejects_bad_inputs() -> None:
    kc = torch.zeros(16, 2, 64, dtype=torch.bfloat16, device=DEV)
    q = torch.zeros(1, 4, 64, device=DEV)
    t = torch.zeros(1, 4, dtype=torch.int32, device=DEV)
    s = torch.ones(1, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="unsupported decode shape"):
        pk.paged_decode_attention(torch.zeros(1, 5, 64, device=DEV), kc, kc, t, s, 4, 1.0)
    with pytest.raises(ValueError, match="k_cache"):
        pk.paged_decode_attention(q, kc.float(), kc.float(), t, s, 4, 1.0)
    with pytest.raises(ValueError, match="int32"):
        pk.paged_decode_attention(q, kc, kc, t.long(), s, 4, 1.0)
    with pytest.raises(ValueError, match="one shape"):
        pk.paged_decode_attention(q, kc, kc[:8], t, s, 4, 1.0)
    with pytest.raises(ValueError, match="pad_slot"):
        pk.paged_store(kc, kc, s.long(), q[:, :2], q[:, :2], 16)


def test_backend_runs_the_kernels() -> None:
    """BF16KVBackend with its kernels on (forced on the CPU: the interpreter) decodes a step
    of two sequences like its references (TINYSERVE_DISABLE_KERNELS=1)."""
    from tests.kv.test_bf16 import _ctx
    from tinyserve.kv.bf16 import BF16KVBackend

    ps, hq, hkv, d = 4, 8, 2, 32
    pages = [[5, 2, 7], [0, 3]]
    gen = torch.Generator().manual_seed(5)
    kvs = []
    for kernels in (True, False):
        kv = BF16KVBackend(layer_ids=[1], num_kv_heads=hkv, num_q_heads=hq, head_dim=d,
                           num_pages=8, page_size=ps, device=DEV, dtype=torch.bfloat16)
        if kernels:  # on the CPU it would not take them itself
            kv.use_kernels = True
            kv._pick_decode(hq)
        kv.k_cache.fill_(float("nan"))
        kv.v_cache.fill_(float("nan"))
        kvs.append(kv)
    outs: list[list[torch.Tensor]] = [[], []]
    for q_lens, prefixes in (([9, 6], [0, 0]), ([1, 1], [9, 6])):
        ctx = _ctx(q_lens, prefixes, pages, ps)
        ctx = replace(ctx, **{f: getattr(ctx, f).to(DEV) for f in ctx.__dataclass_fields__
                              if isinstance(getattr(ctx, f), torch.Tensor)})
        if ctx.is_decode:
            ctx = replace(ctx, max_seq_len=16)  # a graph's capacity: the decode kernel
        n = sum(q_lens)
        q = torch.randn(n, hq, d, generator=gen).bfloat16().to(DEV)
        k = torch.randn(n, hkv, d, generator=gen).bfloat16().to(DEV)
        v = torch.randn(n, hkv, d, generator=gen).bfloat16().to(DEV)
        for out, kv in zip(outs, kvs, strict=True):
            out.append(kv.forward(1, q, k, v, ctx, d ** -0.5).float().cpu())
    assert torch.equal(kvs[0].k_cache.nan_to_num(7.0), kvs[1].k_cache.nan_to_num(7.0))
    for got, want in zip(outs[0], outs[1], strict=True):
        assert not got.isnan().any()
        assert _rel(got, want) < 1e-2


@pytest.mark.requires_cuda
def test_decode_in_cuda_graph() -> None:
    """Captured once at a bound, replayed with other (shorter) lengths: the same as eager.
    NOTE: a length may not pass the pages its row of the table holds (`_paged` poisons the
    rest of the cache)."""
    lens, hq, hkv, d, ps = [700, 48], 16, 2, 256, 16
    kc, vc, table, seq_lens, _ = _paged(lens, hkv, d, ps, 2048, torch.bfloat16, seed=9)
    q = torch.randn(2, hq, d, device="cuda").bfloat16()
    out = torch.empty_like(q)

    def call():
        pk.paged_decode_attention(q, kc, vc, table, seq_lens, ps, d ** -0.5, max_seq_len=2048,
                                  out=out)

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for new_lens in ([700, 48], [650, 40], [1, 1]):
        seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        replayed = out.clone()
        call()
        assert not replayed.isnan().any() and torch.equal(replayed, out), new_lens


_TYPES = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "pt_ptr": "*i32",
          "lens_ptr": "*i32", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
          "scale_log2": "fp32"}
# What the launch specializes at the model's shapes: 16-byte aligned pointers, slot stride 512
# and page size 16 multiples of 16 (the K/V loads become 16-byte asynchronous copies).
_DIVISIBLE = (*(n for n in _TYPES if n.endswith("_ptr")), "slot_stride", "page_size")


@pytest.mark.slow
def test_decode_kernel_builds_for_sm90() -> None:
    """Ahead-of-time build for sm_90 without a GPU (35B-A3B shapes, default settings): fits in
    shared memory and does not spill; the resource usage is printed."""
    from tests.kernels.sm90_build import (
        compile_sm90,
        rerun_without_interpreter,
        resource_usage,
        usage_field,
    )

    if rerun_without_interpreter(__file__, "builds_for_sm90"):
        return
    jf = pk.paged_decode_partial_kernel
    consts = dict(HKV=2, G=8, BLOCK_H=16, D=256, BLOCK_T=pk.BLOCK_T, USE_F32_DOT=False)
    sig = {n: "constexpr" if n in consts else _TYPES.get(n, "i32") for n in jf.arg_names}
    attrs = {(jf.arg_names.index(n),): [["tt.divisibility", 16]] for n in _DIVISIBLE}
    k = compile_sm90(jf, sig, consts, attrs, num_warps=pk.NUM_WARPS, num_stages=pk.NUM_STAGES)
    assert k.metadata.shared <= 100 * 1024  # two programs per SM even on sm_86 / sm_89
    usage = resource_usage(k, "paged_decode_partial")
    if usage is not None:
        print(f"\npaged_decode_partial: shared {k.metadata.shared} B, "
              f"{usage.strip().splitlines()[-1].strip()}")
        assert not usage_field(usage, "STACK"), usage
