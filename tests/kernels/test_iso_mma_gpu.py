"""The tensor-core ISO3 decode kernel on the GPU: q in each dtype and the one-wave split plan
against an fp32 oracle over the dequantized rows; replays of a CUDA graph of the call; the
same bits on every run (and from the graph, and as programmatic dependent launches behind the
store); the occupancy query; 4 and 16 warps per CTA (`iso_mma.WARPS`).
Bound: cosine >= 0.9999 and |out - ref| <= 1e-2 * max|ref| (fp16 operands, bf16 q/out)."""

from __future__ import annotations

import math

import pytest
import torch

from tinyserve.kernels import iso
from tinyserve.kernels.iso import cuda as iso_cuda
from tinyserve.kernels.iso import mma as iso_mma

pytestmark = pytest.mark.requires_cuda
HQ, HKV, D, PS = 16, 2, 256, 16


def _state(lens: list[int], seed: int) -> tuple:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = [math.ceil(n / PS) for n in lens]
    perm = torch.randperm(sum(pages) + 1, device="cuda", generator=gen).int()
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32, device="cuda")
    at = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[at:at + p]
        at += p
    slots = (sum(pages) + 1) * PS
    rb = iso.packed_row_bytes(D, "iso3")
    kc = torch.empty(slots, HKV, rb, dtype=torch.uint8, device="cuda")
    vc = torch.empty_like(kc)
    k = torch.randn(slots, HKV, D, device="cuda", generator=gen)
    v = torch.randn(slots, HKV, D, device="cuda", generator=gen)
    iso_cuda.iso_store(kc, vc, torch.arange(slots, device="cuda"), k, v, "iso3")
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return kc, vc, table, seq


def _oracle(q, kc, vc, table, lens) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32, device="cuda")
    for b, n in enumerate(lens):
        t = torch.arange(n, device="cuda")
        slots = table[b].long()[t // PS] * PS + t % PS
        k = iso_cuda.iso_dequant_rows(kc, slots, "iso3", D, torch.float32)  # [T, HKV, D]
        v = iso_cuda.iso_dequant_rows(vc, slots, "iso3", D, torch.float32)
        qg = q[b].float().reshape(HKV, HQ // HKV, D)
        p = torch.softmax(torch.einsum("hgd,thd->hgt", qg, k) * D ** -0.5, dim=-1)
        out[b] = torch.einsum("hgt,thd->hgd", p, v).reshape(HQ, D)
    return out


def _check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert not out.isnan().any(), what
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert cos >= 0.9999 and err <= 1e-2, f"{what}: cosine {cos.item():.6f}, error {err:.2e}"


SETTINGS = [dict(), dict(warps=4, ctas_per_sm=2, min_split_tokens=128),
            dict(warps=4, ctas_per_sm=0), dict(split_tokens=16),
            dict(warps=16, ctas_per_sm=1, min_split_tokens=128),
            dict(warps=16, ctas_per_sm=0, min_split_tokens=256)]
# both CTA sizes in the graph and determinism tests
WIDE_CTAS = [dict(), dict(warps=4, ctas_per_sm=0), dict(warps=16, ctas_per_sm=0)]


@pytest.mark.parametrize("lens", [[1], [4096], [300, 17, 5000, 1], [20000]],
                         ids=lambda lens: f"len{max(lens)}x{len(lens)}")
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_mma_matches_the_oracle(lens, q_dtype) -> None:
    kc, vc, table, seq = _state(lens, seed=len(lens) + max(lens))
    q = torch.randn(len(lens), HQ, D, device="cuda").to(q_dtype)
    ref = _oracle(q, kc, vc, table, lens)
    for cfg in SETTINGS:
        out = torch.full_like(q, float("nan"))
        iso_mma.iso_decode_attention_mma(q, kc, vc, table, seq, PS, "iso3", D ** -0.5,
                                         max_seq_len=max(lens), out=out, **cfg)
        _check(out, ref, f"{cfg} {q_dtype} {lens}")


@pytest.mark.parametrize("cfg", WIDE_CTAS, ids=lambda c: f"w{c.get('warps', 'default')}")
def test_mma_cuda_graph_replays(cfg) -> None:
    """A captured call replays with new queries and lengths (nothing per call outside the
    graph: the merge has no state between launches)."""
    kc, vc, table, seq = _state([4096, 4096], seed=3)
    q = torch.randn(2, HQ, D, device="cuda").bfloat16()
    out = torch.empty_like(q)

    def call() -> None:
        iso_mma.iso_decode_attention_mma(q, kc, vc, table, seq, PS, "iso3", D ** -0.5,
                                         max_seq_len=4096, out=out, **cfg)

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for new_lens in ([3000, 700], [4096, 1], [17, 2500]):
        q.copy_(torch.randn_like(q))
        seq.copy_(torch.tensor(new_lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, _oracle(q, kc, vc, table, new_lens), f"replay {new_lens}")


@pytest.mark.parametrize("cfg", WIDE_CTAS, ids=lambda c: f"w{c.get('warps', 'default')}")
def test_mma_same_bits_every_run(cfg) -> None:
    """Fixed reduction order: repeated eager calls and a graph replay give identical bits."""
    kc, vc, table, seq = _state([20000, 3000], seed=5)
    q = torch.randn(2, HQ, D, device="cuda").bfloat16()

    def call(out: torch.Tensor) -> torch.Tensor:
        return iso_mma.iso_decode_attention_mma(q, kc, vc, table, seq, PS, "iso3", D ** -0.5,
                                                max_seq_len=20000, out=out, **cfg)

    first = call(torch.empty_like(q)).clone()
    for _ in range(3):
        assert torch.equal(call(torch.full_like(q, float("nan"))), first)
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)


@pytest.mark.parametrize("cfg", WIDE_CTAS + [dict(warps=4, ctas_per_sm=2, min_split_tokens=64)],
                         ids=lambda c: f"w{c.get('warps', 'default')}c{c.get('ctas_per_sm', '')}")
def test_mma_dependent_launches_same_bits(cfg) -> None:
    """The decode kernel and its split merge launched as programmatic dependents (sm_90+):
    the oracle's result and the same bits on every run, eagerly and replayed from a graph
    (programmatic edges), as in a decode step: the query and lengths rewritten, then the
    store kernel writing each sequence's newest row right before the decode kernel; poisoned
    rows, query and output before every run."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    lens = [20000, 3000]
    kc, vc, table, seq = _state(lens, seed=6)
    q = torch.randn(2, HQ, D, device="cuda").bfloat16()
    q_src, seq_src = q.clone(), seq.clone()
    last = torch.tensor([table[b, (n - 1) // PS].item() * PS + (n - 1) % PS
                         for b, n in enumerate(lens)], device="cuda")
    k_new, v_new = (torch.randn(2, HKV, D, device="cuda") for _ in range(2))

    def call(out: torch.Tensor) -> torch.Tensor:
        q.copy_(q_src)
        seq.copy_(seq_src)
        iso_cuda.iso_store(kc, vc, last, k_new, v_new, "iso3")  # the decode waits for this
        return iso_mma.iso_decode_attention_mma(q, kc, vc, table, seq, PS, "iso3", D ** -0.5,
                                                max_seq_len=20000, out=out, **cfg)

    def poison() -> None:
        q.zero_()
        iso_cuda.iso_store(kc, vc, last, -k_new, v_new * 3, "iso3")

    first = call(torch.full_like(q, float("nan"))).clone()
    _check(first, _oracle(q, kc, vc, table, lens), f"first {cfg}")
    for _ in range(3):
        poison()
        assert torch.equal(call(torch.full_like(q, float("nan"))), first)
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(out)
    for _ in range(3):
        out.fill_(float("nan"))
        poison()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)


def test_mma_occupancy() -> None:
    dev = torch.device("cuda")
    for d in (128, 256):
        for warps in iso_mma.WARPS:
            fit = iso_mma.ctas_per_sm_fit(dev, d, warps)
            print(f"head_dim {d}, {warps} warps: {fit} CTAs per SM")
            assert 1 <= fit <= 32
    # head_dim 256, registers for 8 warps per SM (csrc/iso_decode_mma.cu: min_ctas_per_sm):
    # 3 CTAs of 4 warps (151-153 registers), 1 of 16 (128 registers); the shared memory (4
    # warps 36864 B dynamic + 13.8 KB static, 16 warps 147456 + 18 KB) would fit 4 / 1
    assert iso_mma.ctas_per_sm_fit(dev, 256, 4) == 3
    assert iso_mma.ctas_per_sm_fit(dev, 256, 16) == 1
