"""The tensor-core ISO3 decode kernel on the GPU: the split merges ("cols", the previous
"wide"), q read in its dtype or as an fp32 copy, and the one-wave split plan against an fp32
oracle over the dequantized rows; replays of a CUDA graph of the call; the occupancy query.
Bound: cosine >= 0.9999 and |out - ref| <= 1e-2 * max|ref| (fp16 operands, bf16 q/out)."""

from __future__ import annotations

import math

import pytest
import torch

from tinyserve.kernels import iso, iso_cuda, iso_mma

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


SETTINGS = [dict(), dict(merge="wide"), dict(native_q=False), dict(merge="wide", native_q=False),
            dict(warps=4, ctas_per_sm=2, min_split_tokens=128), dict(warps=2, ctas_per_sm=0),
            dict(split_tokens=16)]


@pytest.mark.parametrize("lens", [[1], [4096], [300, 17, 5000, 1], [20000]],
                         ids=lambda lens: f"len{max(lens)}x{len(lens)}")
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_mma_paths_match_the_oracle(lens, q_dtype) -> None:
    kc, vc, table, seq = _state(lens, seed=len(lens) + max(lens))
    q = torch.randn(len(lens), HQ, D, device="cuda").to(q_dtype)
    ref = _oracle(q, kc, vc, table, lens)
    for cfg in SETTINGS:
        out = torch.full_like(q, float("nan"))
        iso_mma.iso_decode_attention_mma(q, kc, vc, table, seq, PS, "iso3", D ** -0.5,
                                         max_seq_len=max(lens), out=out, **cfg)
        _check(out, ref, f"{cfg} {q_dtype} {lens}")


def test_mma_cuda_graph_replays() -> None:
    """A captured call replays with new queries and lengths (nothing per call outside the
    graph: the merge has no state between launches)."""
    kc, vc, table, seq = _state([4096, 4096], seed=3)
    q = torch.randn(2, HQ, D, device="cuda").bfloat16()
    out = torch.empty_like(q)

    def call() -> None:
        iso_mma.iso_decode_attention_mma(q, kc, vc, table, seq, PS, "iso3", D ** -0.5,
                                         max_seq_len=4096, out=out)

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


def test_mma_occupancy() -> None:
    dev = torch.device("cuda")
    for d in (128, 256):
        for warps in (2, 4):
            fit = iso_mma.ctas_per_sm_fit(dev, d, warps)
            print(f"head_dim {d}, {warps} warps: {fit} CTAs per SM")
            assert 1 <= fit <= 32
    assert iso_mma._occupancy(dev, 384, 4) == 0  # no such kernel
