"""ISOKVBackend: sizing, layout, and the store/attend ordering contract on the CPU references."""

from __future__ import annotations

import pytest
import torch

from tinyserve.core import ForwardContext
from tinyserve.kernels import iso
from tinyserve.kv.iso_pool import ISOKVBackend
from tinyserve.kv.registry import create_kv_backend, kv_bytes_per_token

FMTS = ("iso3", "iso4")


def test_bytes_per_token_35b_a3b() -> None:
    assert ISOKVBackend.bytes_per_token(10, 2, 256, fmt="iso3") == 4000
    assert ISOKVBackend.bytes_per_token(10, 2, 256, fmt="iso4") == 5440
    assert kv_bytes_per_token("iso3", 10, 2, 256) == 4000
    assert kv_bytes_per_token("iso4", 10, 2, 256) == 5440
    assert 10 * 2 * 256 * 2 * 2 / 4000 > 5.0


def _make(fmt: str, num_pages: int = 8, page_size: int = 4, hkv: int = 2, d: int = 128,
          hq: int = 4):
    return create_kv_backend(fmt, layer_ids=[3, 7], num_kv_heads=hkv, num_q_heads=hq,
                             head_dim=d, num_pages=num_pages, page_size=page_size, device="cpu",
                             dtype=torch.float32)


@pytest.mark.parametrize("fmt", FMTS)
def test_layout_and_layer_remap(fmt: str) -> None:
    kv = _make(fmt)
    assert isinstance(kv, ISOKVBackend) and kv.fmt == fmt
    rb = iso.packed_row_bytes(128, fmt)
    assert kv.buffer.shape == (2, 2, 9 * 4, 2, rb) and kv.buffer.dtype == torch.uint8
    assert kv.k_cache(7).shape == (36, 2, rb)
    with pytest.raises(KeyError):
        kv.k_cache(4)


def test_head_dim_refused() -> None:
    with pytest.raises(ValueError, match="head_dim % 128"):
        _make("iso3", d=96)


def _ctx(q_lens, prefix_lens, page_table, page_size) -> ForwardContext:
    pos, slots = [], []
    for b, (n, p) in enumerate(zip(q_lens, prefix_lens, strict=True)):
        for t in range(p, p + n):
            pos.append(t)
            slots.append(page_table[b][t // page_size] * page_size + t % page_size)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return ForwardContext(
        input_ids=torch.zeros(len(pos), dtype=torch.int64),
        positions=torch.tensor(pos), cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
        seq_lens=torch.tensor([n + p for n, p in zip(q_lens, prefix_lens, strict=True)],
                              dtype=torch.int32),
        page_table=torch.tensor(page_table, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        state_slots=torch.zeros(len(q_lens), dtype=torch.int64),
        logits_indices=torch.tensor([c - 1 for c in cu[1:]]), page_size=page_size,
        q_lens_cpu=list(q_lens), prefix_lens_cpu=list(prefix_lens))


@pytest.mark.parametrize("fmt", FMTS)
def test_ordering_contract_extend_then_decode(fmt: str) -> None:
    """Extend sees its own chunk unquantized; decode sees its own token quantized."""
    torch.manual_seed(0)
    page_size, hq, hkv, d = 4, 4, 2, 128
    kv = _make(fmt, page_size=page_size)
    pages = [[5, 1, 6, 0], [2, 7, 3, 4]]
    hist_k: list[list[torch.Tensor]] = [[], []]
    hist_v: list[list[torch.Tensor]] = [[], []]
    steps = [([5, 3], [0, 0]), ([3, 2], [5, 3]), ([1, 1], [8, 5]), ([1, 1], [9, 6])]
    scale = d ** -0.5
    for q_lens, prefix in steps:
        n = sum(q_lens)
        q, k, v = torch.randn(n, hq, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
        ctx = _ctx(q_lens, prefix, pages, page_size)
        out = kv.forward(7, q, k, v, ctx, scale)
        decode = ctx.is_decode
        start = 0
        for b, m in enumerate(q_lens):
            kb, vb = k[start:start + m], v[start:start + m]
            qk = [iso.dequantize_ref(iso.quantize_ref(x, fmt), fmt, d) for x in kb]
            qv = [iso.dequantize_ref(iso.quantize_ref(x, fmt), fmt, d) for x in vb]
            own_k, own_v = (qk, qv) if decode else (list(kb), list(vb))
            kk = torch.stack(hist_k[b] + own_k)
            vv = torch.stack(hist_v[b] + own_v)
            ref = iso.attention_oracle(q[start:start + m], kk, vv, prefix[b], scale)
            got = out[start:start + m]
            assert torch.isfinite(got).all()
            cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0)
            assert cos >= 0.9999, f"step {q_lens}/{prefix} seq {b}: cosine {cos}"
            assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4)
            hist_k[b] += qk
            hist_v[b] += qv
            start += m
    # the packed bytes in the pool are exactly quantize_ref of what was stored
    kc = kv.k_cache(7)
    seq0 = iso.gather_rows(kc, torch.tensor(pages[0]), page_size, 10)
    assert torch.equal(iso.dequantize_ref(seq0, fmt, d), torch.stack(hist_k[0]))
    assert kv.k_cache(3).eq(0).all(), "another layer's slab was written"


# ------------------------------------------------------------------------------------------
# Through the tiny model (head_dim 128): ISO KV against the bf16 backend


@pytest.fixture(scope="module")
def hd128():
    pytest.importorskip("transformers")
    from tests.model.hf_tiny import checkpoint

    return checkpoint("bf16", "hd128")


def _runner(cfg, weights, kv_name: str):
    from tinyserve.engine.runner import ModelRunner
    from tinyserve.kv.state_pool import GDNStatePool
    from tinyserve.model.qwen35 import Qwen35Model

    kv = create_kv_backend(kv_name, layer_ids=list(cfg.full_attention_layers),
                           num_kv_heads=cfg.num_kv_heads, num_q_heads=cfg.num_attention_heads,
                           head_dim=cfg.head_dim, num_pages=32, page_size=4, device="cpu",
                           dtype=torch.float32)
    states = GDNStatePool.for_config(cfg, 2, device="cpu", dtype=torch.float32)
    model = Qwen35Model(cfg, weights, kv=kv, states=states, device="cpu", dtype=torch.float32)
    return ModelRunner(model, page_size=4)


def _kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per position."""
    lp, lq = ref_logits.log_softmax(-1), logits.log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


@pytest.mark.parametrize("fmt", FMTS)
def test_tiny_model_logits_close_to_bf16(hd128, fmt: str) -> None:
    """Chunked prefill (extend over a packed prefix) and one-token steps (decode) stay close
    to the bf16 backend; KL is printed."""
    cfg, w = hd128
    ids = torch.randint(0, 500, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = _runner(cfg, w, "bf16").logits(ids, chunk_size=8)
        ext = _runner(cfg, w, fmt).logits(ids, chunk_size=8)
        dec = _runner(cfg, w, fmt).logits(ids, chunk_size=1)
    assert torch.isfinite(ext).all() and torch.isfinite(dec).all()
    kl_ext, kl_dec = _kl(ref, ext), _kl(ref, dec)
    print(f"\n{fmt}: KL vs bf16 extend mean {kl_ext.mean():.2e} max {kl_ext.max():.2e}; "
          f"decode mean {kl_dec.mean():.2e} max {kl_dec.max():.2e}")
    # the first chunk never reads quantized K/V: identical to bf16
    torch.testing.assert_close(ext[:8], ref[:8], rtol=1e-5, atol=1e-5)
    assert kl_ext.max() < 0.01 and kl_dec.max() < 0.01
    assert (ext.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("fmt", FMTS)
def test_tiny_model_generates(hd128, fmt: str) -> None:
    from tests.model.hf_tiny import _ROOT
    from tinyserve.core import SamplingParams
    from tinyserve.engine.llm import LLM

    with LLM(str(_ROOT / "hd128-bf16"), kv=fmt, device="cpu", num_kv_pages=16) as llm:
        outs = llm.generate([[5, 6, 7, 8, 9], [11, 12]],
                            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [6, 6]
    assert all(o.finish_reason == "length" for o in outs)


def test_negative_slot_goes_to_padding_page() -> None:
    kv = _make("iso4", num_pages=2, page_size=4)
    k = torch.randn(2, 2, 128)
    kv.store(3, k, k, torch.tensor([-1, 1]))
    assert torch.equal(kv.k_cache(3)[8], iso.quantize_ref(k[0], "iso4"))
    assert torch.equal(kv.k_cache(3)[1], iso.quantize_ref(k[1], "iso4"))
    assert kv.k_cache(3)[[0, 2, 3, 4, 5, 6, 7]].eq(0).all()


def test_decode_kernel_per_shape() -> None:
    from tinyserve.kernels.iso import DECODE_KERNELS, choose_decode

    # iso3 at GQA groups <= 8 (35B-A3B: 16/2 heads; the tiny models: 4/2, 8/8) takes the CUDA
    # tensor-core kernel; iso4, groups of 16 (122B/397B: 32/2 heads) and caches it cannot
    # copy in 16-byte chunks take Triton
    assert choose_decode("iso3", 16, 2, 256) == "mma"
    assert choose_decode("iso3", 4, 2, 128) == "mma"
    assert choose_decode("iso3", 32, 2, 256) == "triton"
    assert choose_decode("iso4", 16, 2, 256) == "triton"
    assert choose_decode("iso3", 16, 2, 256, aligned=False) == "triton"
    assert set(DECODE_KERNELS) == {"mma", "triton"}


@pytest.mark.parametrize("fmt, hq, want", [("iso3", 16, "mma"), ("iso4", 16, "triton"),
                                           ("iso3", 32, "triton")])
def test_decode_dispatch(fmt: str, hq: int, want: str, monkeypatch) -> None:
    """With the kernels on, decode goes to the kernel `choose_decode` picks for the pool's
    shapes (bound from the pool's context) at every step (the kernels are stubs here)."""
    from tinyserve.kernels.iso import mma as iso_mma
    from tinyserve.kernels.iso import triton as iso_triton

    calls = []

    def stub(name):
        def run(q, kc, vc, table, seq_lens, page_size, fmt_, scale, *, max_seq_len):
            calls.append((name, fmt_, page_size, max_seq_len, tuple(kc.shape)))
            return torch.zeros_like(q)
        return run

    monkeypatch.setattr(iso_mma, "iso_decode_attention_mma", stub("mma"))
    monkeypatch.setattr(iso_triton, "iso_decode_attention_triton", stub("triton"))
    kv = _make(fmt, d=256, hq=hq)
    kv._pick_decode(hq)  # what the constructor does on CUDA
    ctx = _ctx([1, 1], [5, 2], [[0, 1], [2, 3]], 4)
    for _ in range(2):
        out = kv._decode(7, torch.randn(2, hq, 256), ctx, 0.1)
        assert out.shape == (2, hq, 256)
    assert calls == [(want, fmt, 4, ctx.seq_len_bound, tuple(kv.k_cache(7).shape))] * 2
