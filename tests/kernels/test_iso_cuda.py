"""ISO kernels against the torch references (GPU only).

Store and row dequantization compare bytes / bits exactly; decode (the CUDA tensor-core kernel
where it applies, the Triton kernel elsewhere) and extend attention compare
against fp32 attention over `dequantize_ref`-equal rows (cosine >= 0.9999, max relative error
printed). Output buffers and caches are poisoned first so unwritten elements fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinyserve.kernels import iso

pytestmark = pytest.mark.requires_cuda
FMTS = ("iso3", "iso4")
POISON = 0xAB


def _cuda():
    from tinyserve.kernels.iso import cuda as iso_cuda

    return iso_cuda


def _mma():
    from tinyserve.kernels.iso import mma as iso_mma

    return iso_mma


def _extend():
    from tinyserve.kernels.iso import extend as iso_extend

    return iso_extend


@pytest.fixture(scope="module")
def golden(shared_dir):
    return np.load(shared_dir / "data" / "iso_golden.npz")


@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("fmt", FMTS)
def test_store_golden_rows(golden, fmt: str, loc_dtype: torch.dtype) -> None:
    x = torch.from_numpy(golden["x"]).cuda()  # [173, 256] fp32, as 173 tokens x 1 head
    n = x.shape[0]
    rb = iso.packed_row_bytes(256, fmt)
    kc = torch.full((n + 5, 1, rb), POISON, dtype=torch.uint8, device="cuda")
    vc = torch.full_like(kc, POISON)
    loc = torch.randperm(n + 5, device="cuda")[:n].to(loc_dtype)
    _cuda().iso_store(kc, vc, loc, x[:, None], x[:, None].clone(), fmt)
    got = kc[loc.long(), 0].cpu().numpy()
    assert np.array_equal(got, vc[loc.long(), 0].cpu().numpy())
    want = golden[fmt]
    tie = golden["kind"] == "near_tie"
    bad = (got != want).any(axis=1)
    bb = iso.BLOCK_BYTES[fmt]
    norm_ulp = 0
    for r in np.nonzero(bad)[0]:
        for blk in range(2):
            g, w = got[r, blk * bb:(blk + 1) * bb], want[r, blk * bb:(blk + 1) * bb]
            if np.array_equal(g[2:], w[2:]):
                norm_ulp += int(abs(int(g[:2].view(np.uint16)[0]) - int(w[:2].view(np.uint16)[0]))
                                == 1)
    print(f"\n{fmt}: {bad[~tie].sum()} ordinary and {bad[tie].sum()}/{tie.sum()} near_tie rows "
          f"differ; {norm_ulp} blocks differ only by 1 ulp of the norm")
    assert not bad[~tie].any(), f"{fmt}: rows {np.nonzero(bad & ~tie)[0].tolist()} differ"
    untouched = torch.ones(n + 5, dtype=torch.bool, device="cuda")
    untouched[loc.long()] = False
    assert (kc[untouched] == POISON).all()


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n,heads,d", [(1, 1, 128), (37, 2, 256), (300, 4, 128)])
def test_store_bf16_and_dequant(fmt: str, n: int, heads: int, d: int) -> None:
    torch.manual_seed(n + d)
    k = (torch.randn(n, heads, d, device="cuda") * 2.5).bfloat16()
    v = torch.randn(n, heads, d, device="cuda").bfloat16()
    rb = iso.packed_row_bytes(d, fmt)
    kc = torch.full((n * 2, heads, rb), POISON, dtype=torch.uint8, device="cuda")
    vc = torch.full_like(kc, POISON)
    loc = torch.randperm(n * 2, device="cuda")[:n]
    _cuda().iso_store(kc, vc, loc, k, v, fmt)
    want_k, want_v = iso.quantize_ref(k.float().cpu(), fmt), iso.quantize_ref(v.float().cpu(), fmt)
    got_k, got_v = kc[loc].cpu(), vc[loc].cpu()
    rows_k = (got_k != want_k).any(-1).sum().item()
    rows_v = (got_v != want_v).any(-1).sum().item()
    print(f"{fmt}: differing (token, head) rows K {rows_k} V {rows_v}")
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    deq = _cuda().iso_dequant_rows(kc, loc, fmt, d, torch.float32).cpu()
    ref = iso.dequantize_ref(kc[loc].cpu(), fmt, d)
    assert torch.equal(deq, ref)
    hm = _cuda().iso_dequant_rows(kc, loc, fmt, d, torch.bfloat16, head_major=True).cpu()
    assert torch.equal(hm, ref.bfloat16().transpose(0, 1))
    # into the head of a larger head-major buffer (the extend path's prefix rows), the rest
    # of the buffer left as it was
    big = torch.full((heads, n + 5, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    _cuda().iso_dequant_rows(kc, loc, fmt, d, torch.bfloat16, head_major=True,
                             out=big[:, :n])
    assert torch.equal(big[:, :n].cpu(), ref.bfloat16().transpose(0, 1))
    assert big[:, n:].isnan().all()
    with pytest.raises(ValueError, match="contiguous last dimension"):
        _cuda().iso_dequant_rows(kc, loc, fmt, d, torch.bfloat16, head_major=True,
                                 out=torch.empty(heads, d, n + 1, dtype=torch.bfloat16,
                                                 device="cuda")[..., :n].transpose(1, 2))
    with pytest.raises(ValueError, match="out must be"):
        _cuda().iso_dequant_rows(kc, loc, fmt, d, torch.float32, head_major=True,
                                 out=big[:, :n])


def _filled_cache(fmt, total_tokens, hkv, d, page_size, lens, seed):
    """Random bf16 K/V stored through the kernel into pages assigned at random."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages_per = [(n + page_size - 1) // page_size for n in lens]
    num_pages = sum(pages_per) + 1
    perm = torch.randperm(num_pages, device="cuda", generator=gen)
    max_pages = max(pages_per)
    table = torch.zeros(len(lens), max_pages, dtype=torch.int32, device="cuda")
    at = 0
    for b, p in enumerate(pages_per):
        table[b, :p] = perm[at:at + p].int()
        at += p
    rb = iso.packed_row_bytes(d, fmt)
    kc = torch.full((num_pages * page_size, hkv, rb), POISON, dtype=torch.uint8, device="cuda")
    vc = torch.full_like(kc, POISON)
    for b, n in enumerate(lens):
        t = torch.arange(n, device="cuda")
        slots = table[b].long()[t // page_size] * page_size + t % page_size
        k = torch.randn(n, hkv, d, device="cuda", generator=gen).bfloat16()
        v = torch.randn(n, hkv, d, device="cuda", generator=gen).bfloat16()
        k[:, :, 3] *= 20  # an outlier channel
        _cuda().iso_store(kc, vc, slots, k, v, fmt)
    return kc, vc, table


def _seq_rows(cache, table, b, n, page_size, fmt, d):
    t = torch.arange(n, device="cuda")
    slots = table[b].long()[t // page_size] * page_size + t % page_size
    return _cuda().iso_dequant_rows(cache, slots, fmt, d, torch.float32)


def _compare(got, ref, label):
    got, ref = got.float(), ref.float()
    assert torch.isfinite(got).all(), f"{label}: non-finite output (unwritten?)"
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    print(f"\n{label}: cosine {cos:.7f} max rel err {rel:.2e}")
    assert cos >= 0.9999, f"{label}: cosine {cos}"


DECODE_CASES = [
    # (hq, hkv, d, page_size, lens)
    (16, 2, 256, 16, [1]),
    (16, 2, 256, 16, [1, 17, 300, 4097]),
    (16, 2, 256, 1, [33, 2]),
    (16, 2, 256, 64, [1000, 64, 65]),
    (8, 8, 128, 16, [5, 513]),
    (16, 1, 128, 32, [700, 1]),
    (4, 2, 256, 16, [257]),
    (16, 2, 256, 64, [32768]),
    (16, 2, 256, 256, [131072, 3]),
]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("case", DECODE_CASES,
                         ids=[f"hq{c[0]}-hkv{c[1]}-d{c[2]}-ps{c[3]}-len{max(c[4])}x{len(c[4])}"
                              for c in DECODE_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("impl", ["mma", "triton"])
def test_decode_attention(impl, fmt, case, dtype) -> None:
    hq, hkv, d, ps, lens = case
    if dtype == torch.float32 and max(lens) > 5000:
        pytest.skip("long contexts run in bf16 only")
    from tinyserve.kernels.iso import choose_decode

    if choose_decode(fmt, hq, hkv, d) != impl:
        pytest.skip(f"{fmt} {hq}/{hkv} heads, head_dim {d} decodes with the other kernel")
    kc, vc, table = _filled_cache(fmt, sum(lens), hkv, d, ps, lens, seed=len(lens) + d)
    q = torch.randn(len(lens), hq, d, device="cuda").to(dtype)
    out = torch.full_like(q, float("nan"))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = d ** -0.5
    if impl == "mma":
        _mma().iso_decode_attention_mma(q, kc, vc, table, seq_lens, ps, fmt, scale, out=out)
    else:
        from tinyserve.kernels.iso import triton as iso_triton

        iso_triton.iso_decode_attention_triton(q, kc, vc, table, seq_lens, ps, fmt, scale,
                                               out=out)
    for b, n in enumerate(lens):
        kd = _seq_rows(kc, table, b, n, ps, fmt, d)
        vd = _seq_rows(vc, table, b, n, ps, fmt, d)
        ref = iso.attention_oracle(q[b:b + 1].float(), kd, vd, n - 1, scale)[0]
        _compare(out[b], ref, f"decode {impl} {fmt} {case} {dtype} seq {b} len {n}")


EXTEND_CASES = [
    # (hq, hkv, d, page_size, prefix_lens, chunk_lens)
    (16, 2, 256, 16, [0], [7]),
    (16, 2, 256, 16, [0, 5, 300, 2000], [7, 64, 1, 33]),
    (8, 8, 128, 1, [17, 0], [3, 129]),
    (16, 2, 256, 64, [30000], [2048]),
]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("case", EXTEND_CASES,
                         ids=[f"hq{c[0]}-d{c[2]}-ps{c[3]}-pre{max(c[4])}-q{max(c[5])}"
                              for c in EXTEND_CASES])
def test_extend_attention(fmt, case) -> None:
    hq, hkv, d, ps, prefixes, chunks = case
    lens = [p + n for p, n in zip(prefixes, chunks, strict=True)]
    kc, vc, table = _filled_cache(fmt, sum(lens), hkv, d, ps, [max(p, 1) for p in prefixes],
                                  seed=7)
    # page tables must cover prefix + chunk: give every sequence fresh pages for its chunk
    need = max((n + ps - 1) // ps for n in lens)
    big = torch.zeros(len(lens), need, dtype=torch.int32, device="cuda")
    big[:, :table.shape[1]] = table
    n_tok = sum(chunks)
    q = torch.randn(n_tok, hq, d, device="cuda").bfloat16()
    k = torch.randn(n_tok, hkv, d, device="cuda").bfloat16()
    v = torch.randn(n_tok, hkv, d, device="cuda").bfloat16()
    scale = d ** -0.5
    out = _extend().iso_extend_attention(q, k, v, kc, vc, big, chunks, prefixes, ps, fmt, scale)
    start = 0
    for b, (p, n) in enumerate(zip(prefixes, chunks, strict=True)):
        kd = _seq_rows(kc, big, b, p, ps, fmt, d)
        vd = _seq_rows(vc, big, b, p, ps, fmt, d)
        kk = torch.cat([kd, k[start:start + n].float()])
        vv = torch.cat([vd, v[start:start + n].float()])
        ref = iso.attention_oracle(q[start:start + n].float(), kk, vv, p, scale)
        _compare(out[start:start + n], ref, f"extend {fmt} {case} seq {b}")
        start += n


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("hq", [16, 32])
def test_pool_on_cuda_matches_cpu(fmt: str, hq: int) -> None:
    """The whole backend (store + decode + extend) on CUDA against the CPU references: GQA
    groups of 8 (35B-A3B: iso3 decodes on the CUDA tensor cores) and 16 (122B: Triton), the
    decode kernel chosen when the pool is built."""
    from tests.kv.test_iso_pool import _ctx
    from tinyserve.kv.iso_pool import ISOKVBackend

    torch.manual_seed(1)
    kw = dict(layer_ids=[3], num_kv_heads=2, num_q_heads=hq, head_dim=256, num_pages=16,
              page_size=16)
    gpu = ISOKVBackend(device="cuda", dtype=torch.bfloat16, fmt=fmt, **kw)
    cpu = ISOKVBackend(device="cpu", dtype=torch.float32, fmt=fmt, **kw)
    want = "mma" if fmt == "iso3" and hq == 16 else "triton"
    assert gpu.decode_impl == iso.DECODE_KERNELS[want] and gpu._decode_fn is not None
    pages = [[3, 9, 1, 4], [0, 2, 5, 6]]
    for q_lens, prefix in [([20, 5], [0, 0]), ([1, 1], [20, 5]), ([1, 1], [21, 6])]:
        n = sum(q_lens)
        q = torch.randn(n, hq, 256).bfloat16()
        k = torch.randn(n, 2, 256).bfloat16()
        v = torch.randn(n, 2, 256).bfloat16()
        ctx = _ctx(q_lens, prefix, pages, 16)
        ref = cpu.forward(3, q.float(), k.float(), v.float(), ctx, 256 ** -0.5)
        ctx_gpu = _ctx(q_lens, prefix, pages, 16)
        for name in ("positions", "cu_seqlens", "prefix_lens", "seq_lens", "page_table",
                     "slot_mapping"):
            setattr(ctx_gpu, name, getattr(ctx_gpu, name).cuda())
        got = gpu.forward(3, q.cuda(), k.cuda(), v.cuda(), ctx_gpu, 256 ** -0.5)
        _compare(got.cpu(), ref, f"pool {fmt} hq {hq} {q_lens}/{prefix}")
    assert torch.equal(gpu.buffer.cpu(), cpu.buffer)


@pytest.mark.parametrize("fmt", FMTS)
def test_tiny_model_on_cuda_close_to_bf16(fmt: str) -> None:
    """The tiny head_dim-128 model on the GPU (bf16) with ISO KV against the bf16 backend:
    chunked prefill and one-token decode steps; KL printed."""
    pytest.importorskip("transformers")
    from tests.model.hf_tiny import checkpoint
    from tinyserve.engine.runner import ModelRunner
    from tinyserve.kv.registry import create_kv_backend
    from tinyserve.kv.state_pool import GDNStatePool
    from tinyserve.model.qwen35 import Qwen35Model

    cfg, w = checkpoint("bf16", "hd128")

    def logits(kv_name: str, chunk: int) -> torch.Tensor:
        kv = create_kv_backend(kv_name, layer_ids=list(cfg.full_attention_layers),
                               num_kv_heads=cfg.num_kv_heads,
                               num_q_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                               num_pages=32, page_size=16, device="cuda", dtype=torch.bfloat16)
        states = GDNStatePool.for_config(cfg, 2, device="cuda", dtype=torch.bfloat16)
        model = Qwen35Model(cfg, w, kv=kv, states=states, device="cuda", dtype=torch.bfloat16)
        return ModelRunner(model, page_size=16).logits(ids, chunk_size=chunk).float().cpu()

    ids = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = logits("bf16", 16).log_softmax(-1)
        for chunk in (16, 1):
            got = logits(fmt, chunk).log_softmax(-1)
            assert torch.isfinite(got).all()
            kl = (ref.exp() * (ref - got)).sum(-1)
            print(f"\n{fmt} chunk {chunk}: KL vs bf16 mean {kl.mean():.2e} max {kl.max():.2e}")
            assert kl.max() < 0.05
