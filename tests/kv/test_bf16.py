"""Paged bf16 KV backend: writes land at their slots, attention over scattered pages equals a
contiguous reference, poisoned pages never leak, padded rows go to the padding page."""

from __future__ import annotations

import pytest
import torch

from tinyserve.core import ForwardContext
from tinyserve.kv.bf16 import BF16KVBackend, causal_attention
from tinyserve.kv.registry import create_kv_backend, kv_bytes_per_token


def _ctx(q_lens: list[int], prefixes: list[int], pages: list[list[int]], ps: int,
         pad_rows: int = 0) -> ForwardContext:
    slots, positions, cu = [], [], [0]
    for n, p, pg in zip(q_lens, prefixes, pages, strict=True):
        for t in range(p, p + n):
            positions.append(t)
            slots.append(pg[t // ps] * ps + t % ps)
        cu.append(cu[-1] + n)
    slots += [-1] * pad_rows
    width = max(len(p) for p in pages)
    table = [p + [0] * (width - len(p)) for p in pages]
    N = cu[-1]
    return ForwardContext(
        input_ids=torch.zeros(N, dtype=torch.int64),
        positions=torch.tensor(positions), cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        prefix_lens=torch.tensor(prefixes, dtype=torch.int32),
        seq_lens=torch.tensor([a + b for a, b in zip(q_lens, prefixes, strict=True)],
                              dtype=torch.int32),
        page_table=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        state_slots=torch.zeros(len(q_lens), dtype=torch.int64),
        logits_indices=torch.zeros(0, dtype=torch.int64), page_size=ps,
        q_lens_cpu=q_lens, prefix_lens_cpu=prefixes)


def _plain_attention(q, k, v, prefix, scale):
    """fp64 softmax attention with GQA by explicit head mapping."""
    n, Hq, D = q.shape
    rep = Hq // k.shape[1]
    out = torch.empty(n, Hq, D, dtype=torch.float64)
    for h in range(Hq):
        s = (q[:, h].double() @ k[:, h // rep].double().T) * scale  # [n, S]
        mask = torch.arange(k.shape[0])[None, :] > (torch.arange(n)[:, None] + prefix)
        out[:, h] = torch.softmax(s.masked_fill(mask, float("-inf")), -1) @ v[:, h // rep].double()
    return out


def test_bytes_per_token_35b() -> None:
    assert BF16KVBackend.bytes_per_token(10, 2, 256) == 20_480
    assert kv_bytes_per_token("bf16", 10, 2, 256) == 20_480


@pytest.mark.parametrize("Hq,Hkv,D", [(4, 2, 32), (8, 1, 16), (2, 2, 8)], ids=str)
def test_causal_attention_matches_plain(Hq: int, Hkv: int, D: int) -> None:
    g = torch.Generator().manual_seed(Hq * D)
    prefix, n = 5, 4
    q = torch.randn(n, Hq, D, generator=g)
    k = torch.randn(prefix + n, Hkv, D, generator=g)
    v = torch.randn(prefix + n, Hkv, D, generator=g)
    got = causal_attention(q, k, v, prefix, D ** -0.5)
    torch.testing.assert_close(got.double(), _plain_attention(q, k, v, prefix, D ** -0.5),
                               rtol=1e-5, atol=1e-5)


def test_two_steps_scattered_pages_poisoned() -> None:
    """Prefill two sequences, then decode one and extend the other; compare with attention
    over the contiguous K/V, with every untouched page NaN."""
    ps, Hq, Hkv, D = 4, 4, 2, 16
    kv = create_kv_backend("bf16", layer_ids=[3, 7], num_kv_heads=Hkv, num_q_heads=Hq,
                           head_dim=D, num_pages=12, page_size=ps, device="cpu",
                           dtype=torch.float32)
    kv.k_cache.fill_(float("nan"))
    kv.v_cache.fill_(float("nan"))
    pages = [[9, 2, 5], [0, 11, 4, 7]]
    g = torch.Generator().manual_seed(0)
    full_k = [torch.randn(12, Hkv, D, generator=g) for _ in range(2)]
    full_v = [torch.randn(12, Hkv, D, generator=g) for _ in range(2)]
    full_q = [torch.randn(12, Hq, D, generator=g) for _ in range(2)]
    steps = [([6, 3], [0, 0]), ([1, 5], [6, 3])]
    for q_lens, prefixes in steps:
        ctx = _ctx(q_lens, prefixes, pages, ps)
        rows = [range(p, p + n) for n, p in zip(q_lens, prefixes, strict=True)]
        q = torch.cat([full_q[b][list(r)] for b, r in enumerate(rows)])
        k = torch.cat([full_k[b][list(r)] for b, r in enumerate(rows)])
        v = torch.cat([full_v[b][list(r)] for b, r in enumerate(rows)])
        out = kv.forward(7, q, k, v, ctx, D ** -0.5)
        assert torch.isfinite(out).all()
        start = 0
        for b, (n, p) in enumerate(zip(q_lens, prefixes, strict=True)):
            want = _plain_attention(full_q[b][p:p + n], full_k[b][:p + n], full_v[b][:p + n], p,
                                    D ** -0.5)
            torch.testing.assert_close(out[start:start + n].double(), want, rtol=1e-5, atol=1e-5)
            start += n
    # Layer 3 was never written; the other layer's pages outside the sequences stay NaN.
    assert torch.isnan(kv.layer_cache(3)[0]).all()
    assert torch.isnan(kv.layer_cache(7)[0][[1, 3, 6, 8, 10]]).all()


def test_negative_slots_go_to_padding_page() -> None:
    kv = BF16KVBackend(layer_ids=[0], num_kv_heads=1, num_q_heads=1, head_dim=4, num_pages=2,
                       page_size=2, device="cpu", dtype=torch.float32)
    kv.k_cache.fill_(float("nan"))
    k = torch.ones(3, 1, 4)
    kv.write(0, k, k, torch.tensor([3, -1, -1]))
    kc, _ = kv.layer_cache(0)
    assert torch.equal(kc[1, 1], k[0]) and torch.isnan(kc[0]).all()
    assert torch.equal(kc[2, 0], k[0])  # the padding page (index num_pages)


@pytest.mark.requires_cuda
def test_bf16_on_cuda_matches_cpu() -> None:
    ps, Hq, Hkv, D = 16, 16, 2, 256
    g = torch.Generator().manual_seed(1)
    pages = [[3, 1, 0], [2]]
    ctx = _ctx([40, 7], [0, 0], pages, ps)
    q = torch.randn(47, Hq, D, generator=g).bfloat16()
    k = torch.randn(47, Hkv, D, generator=g).bfloat16()
    v = torch.randn(47, Hkv, D, generator=g).bfloat16()
    outs = []
    for dev in ("cpu", "cuda"):
        kv = BF16KVBackend(layer_ids=[0], num_kv_heads=Hkv, num_q_heads=Hq, head_dim=D,
                           num_pages=4, page_size=ps, device=dev, dtype=torch.bfloat16)
        c = ForwardContext(**{f: (getattr(ctx, f).to(dev) if isinstance(getattr(ctx, f),
                                                                         torch.Tensor)
                                  else getattr(ctx, f)) for f in ctx.__dataclass_fields__})
        outs.append(kv.forward(0, q.to(dev), k.to(dev), v.to(dev), c, D ** -0.5).float().cpu())
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)
