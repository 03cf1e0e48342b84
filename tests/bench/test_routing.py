"""Realistic routing (bench.routing): the design, the tiny checkpoint that carries it, the
model's routing equal to the computed one, and the calibrated hit rates."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench.cache_sim import hit_curve, trace_from_checkpoint
from bench.routing import (
    ROUTING_FILE,
    RealisticRouting,
    channel_layout,
    make_realistic_tiny_checkpoint,
)
from tinyserve.core import SamplingParams
from tinyserve.kernels.nvfp4.ref import dequantize_nvfp4, quantize_nvfp4

TEXT = range(491)  # the tiny tokenizer's regular tokens


def _full(seed: int = 0, vocab: int = 600) -> RealisticRouting:
    return RealisticRouting(hidden=2048, num_experts=256, top_k=8, vocab_size=vocab,
                            text_tokens=TEXT, seed=seed)


def test_design_is_deterministic_in_its_seed() -> None:
    a, b, c = _full(0), _full(0), _full(1)
    assert np.array_equal(a.cycle, b.cycle) and torch.equal(a.embed_block, b.embed_block)
    assert torch.equal(a.router(3), b.router(3))
    assert not np.array_equal(a.cycle, c.cycle)
    assert not torch.equal(a.router(3), c.router(3))
    assert not torch.equal(a.router(3), a.router(4))
    # the text and the routers do not depend on the vocabulary size
    big = _full(0, vocab=2048)
    assert np.array_equal(a.cycle, big.cycle) and torch.equal(a.router(0), big.router(0))
    assert torch.equal(a.embed_block[a.cycle], big.embed_block[a.cycle])


def test_router_reads_only_the_routing_channels() -> None:
    d = _full()
    lay = d.layout
    assert (lay.reserved.start, lay.reserved.stop, lay.const) == (1920, 2048, 1920)
    w = d.router(0)
    assert w.shape == (256, 2048)
    assert not w[:, :lay.reserved.start].any() and w[:, lay.reserved].abs().min() > 0
    assert torch.equal(w, w.to(torch.bfloat16).float())  # bf16 values, as written
    assert channel_layout(64).token_dims == 8
    with pytest.raises(ValueError, match="too small"):
        channel_layout(16)


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_text_walks_the_cycle_through_an_nvfp4_lm_head(seed: int) -> None:
    d = _full(seed)
    lay = d.layout
    head = dequantize_nvfp4(quantize_nvfp4(d.lm_head(500)), dtype=torch.float32)  # [500, H]
    content = 0.02 * torch.randn(600, 2048, generator=torch.Generator().manual_seed(seed))
    emb = d.embedding(content)
    assert torch.equal(emb[:, :lay.reserved.start], content[:, :lay.reserved.start])
    # the final norm divides by one number per token and multiplies the routing channels by 1
    x = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()
    nxt = (x @ head.T).argmax(-1)
    assert all(int(nxt[t]) == d.next_token[t] for t in d.cycle.tolist())
    for t in (491, 495, 599):  # special and out-of-tokenizer ids: a unique successor too
        assert d.text(t, 3) == [int(nxt[t]), d.next_token[int(nxt[t])],
                                d.next_token[d.next_token[int(nxt[t])]]]
    text = d.text(int(d.cycle[5]), 2 * len(d.cycle))
    assert text[:len(d.cycle)] == text[len(d.cycle):]  # a cycle of all 491 regular tokens
    assert sorted(text[:len(d.cycle)]) == list(TEXT)


def test_expected_topk_ignores_the_per_token_scale() -> None:
    d = _full()
    routers = [d.router(la) for la in range(2)]
    tokens = d.text(int(d.cycle[0]), 20)
    a = d.expected_topk(tokens, routers)
    scaled = d.embed_block[tokens] * torch.linspace(0.1, 30, 20)[:, None]
    from bench.routing import expected_topk

    b = expected_topk(scaled, routers, d.reserved, 8)
    assert a.shape == (20, 2, 8) and np.array_equal(a, b)


def _decode(path, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and the recorded decode routing [n - 1, L, k] of the CPU model."""
    from tinyserve.engine.llm import LLM

    llm = LLM(str(path), device="cpu", max_context=64)
    try:
        model = llm.engine.runner.model
        calls = []
        forward = model.experts.forward

        def recording(layer_id, x, ids, weights, **kw):
            calls.append(ids.clone())
            return forward(layer_id, x, ids, weights, **kw)

        model.experts.forward = recording
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n,
                                                    ignore_eos=True))[0]
    finally:
        llm.engine.shutdown()
    steps = [ids[0].tolist() for ids in calls if ids.shape[0] == 1]
    return out.token_ids, np.array(steps).reshape(n - 1, len(model.layers), -1)


@pytest.mark.parametrize("fmt", ["bf16", "bf16-official", "modelopt-mixed", "compressed-tensors"])
def test_tiny_realistic_checkpoint_routes_as_computed(tmp_path, fmt: str) -> None:
    path = make_realistic_tiny_checkpoint(tmp_path / "ck", fmt=fmt, num_experts=16,
                                          num_experts_per_tok=4)
    manifest = json.loads((path / ROUTING_FILE).read_text())
    cycle = manifest["cycle"]
    assert manifest["routing"] == "realistic" and len(cycle) == 8
    tokens, routed = _decode(path, [5, 17, 300, 42], 12)
    nxt = dict(zip(cycle, cycle[1:] + cycle[:1], strict=True))
    assert tokens[0] == nxt.get(42, tokens[0])
    assert all(nxt[a] == b for a, b in zip(tokens, tokens[1:], strict=False))
    computed = trace_from_checkpoint(path, tokens[:-1])
    assert routed.shape == computed.shape == (11, 4, 4)
    assert all(set(a) == set(b) for a, b in zip(routed.reshape(-1, 4).tolist(),
                                                computed.reshape(-1, 4).tolist(), strict=True))


def test_realistic_routing_needs_an_untied_lm_head(tmp_path) -> None:
    with pytest.raises(ValueError, match="untied"):
        make_realistic_tiny_checkpoint(tmp_path / "y", tie_word_embeddings=True)


def test_calibrated_lru_hit_rates_match_the_published_curve() -> None:
    """Plain LRU, 8 layers of the full-size design (docs/ROUTING.md: ~41 % at 6.6 % of the
    experts resident, 74-83 % at 33 %, +-5 points)."""
    d = _full()
    trace = d.expected_topk(d.text(int(d.cycle[0]), 350), [d.router(la) for la in range(8)])
    curve = hit_curve(trace, 256, (0.066, 0.33), ("lru-layer",), warmup=100)["lru-layer"]
    assert 0.36 <= curve[0.066] <= 0.46, curve
    assert 0.69 <= curve[0.33] <= 0.88, curve
