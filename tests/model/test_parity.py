"""The tinyserve model equals transformers' Qwen3_5MoeForCausalLM (CPU, fp32): full logits,
greedy decoding, batching, chunked prefill and cached decode. KV pages and GDN state slots are
NaN-poisoned before every run, so an unwritten or wrongly read element fails the test."""

from __future__ import annotations

import pytest
import torch

from tests.model.hf_tiny import build_runner, checkpoint, hf_reference
from tinyserve.core import Batch, SamplingParams, ScheduledSeq

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
FORMATS = ["bf16", "bf16-official", "modelopt", "compressed-tensors"]


@pytest.fixture(scope="module", params=["tiny", "hd128"])
def pair(request):
    """(config, weights, HF reference) of the bf16 tiny checkpoint of one geometry."""
    cfg, w = checkpoint("bf16", request.param)
    return cfg, hf_reference("bf16", request.param), w


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Relative 1e-4 of the logit scale (fp32 agreement is ~1e-6)."""
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    scale = ref.abs().max().item()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * scale)


@torch.no_grad()
def _hf_cached(hf, ids: list[int], prefill: int) -> torch.Tensor:
    """HF logits of prefill(ids[:prefill]) then one cached decode step per remaining token."""
    x = torch.tensor([ids])
    out = hf(x[:, :prefill], use_cache=True)
    logits, past = [out.logits[0]], out.past_key_values
    for t in range(prefill, len(ids)):
        out = hf(x[:, t:t + 1], past_key_values=past, use_cache=True)
        logits.append(out.logits[0])
        past = out.past_key_values
    return torch.cat(logits)


@pytest.mark.parametrize("geometry,fmt", [("tiny", f) for f in FORMATS] + [("hd128", "bf16"),
                                                                        ("hd128", "modelopt")])
def test_full_logits(geometry: str, fmt: str) -> None:
    """Every checkpoint format; NVFP4 against transformers running the dequantized weights."""
    cfg, w = checkpoint(fmt, geometry)
    hf = hf_reference(fmt, geometry)
    runner = build_runner(cfg, w)
    ids = _ids(70, seed=1)  # two GDN chunks of 64
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0]
    _close(runner.logits(ids), ref)


def test_chunked_prefill_then_decode(pair) -> None:
    """Prefill in chunks of 7, then token-by-token decode, equals HF's cached decode and the
    one-piece prefill."""
    cfg, hf, w = pair
    runner = build_runner(cfg, w)
    ids = _ids(30, seed=2)
    ref = _hf_cached(hf, ids, prefill=21)
    one_piece = runner.logits(ids[:21])
    runner = build_runner(cfg, w)
    chunked = runner.logits(ids[:21], chunk_size=7, state_slot=1, page_ids=list(range(8)))
    _close(chunked, one_piece)
    decoded = [chunked]
    for t in range(21, 30):
        seq = ScheduledSeq("r", [ids[t]], start_pos=t, page_ids=list(range(8)), state_slot=1,
                           sample=True, params=GREEDY)
        decoded.append(runner.forward(Batch([seq])).logits)
    _close(torch.cat(decoded), ref)


def test_batch_equals_alone(pair) -> None:
    """Three prompts of different lengths in one forward (then mixed with decode steps) equal
    each run alone; pages are scattered and out of order."""
    cfg, _, w = pair
    prompts = [_ids(n, seed=10 + n) for n in (5, 13, 9)]
    pages = [[7, 2, 11], [0, 9, 4, 15, 1], [3, 14, 6, 12]]
    slots = [2, 0, 3]
    alone = []
    for p in prompts:
        r = build_runner(cfg, w)
        alone.append(r.logits(p + [1, 2]))
    runner = build_runner(cfg, w)
    seqs = [ScheduledSeq(f"r{i}", p, 0, pages[i], slots[i], True, GREEDY)
            for i, p in enumerate(prompts)]
    got = [[] for _ in prompts]
    out = runner.forward(Batch(seqs))
    for i in range(3):
        got[i].append(out.logits[i])
    # Step 2: sequence 1 restarts a prefill chunk of two tokens while the others decode.
    step = [ScheduledSeq("r0", [1], 5, pages[0], slots[0], True, GREEDY),
            ScheduledSeq("r1", [1, 2], 13, pages[1], slots[1], True, GREEDY),
            ScheduledSeq("r2", [1], 9, pages[2], slots[2], True, GREEDY)]
    out = runner.forward(Batch(step))
    got[0].append(out.logits[0])
    got[1].append(out.logits[1])
    got[2].append(out.logits[2])
    step = [ScheduledSeq("r0", [2], 6, pages[0], slots[0], True, GREEDY),
            ScheduledSeq("r2", [2], 10, pages[2], slots[2], True, GREEDY)]
    out = runner.forward(Batch(step))
    got[0].append(out.logits[0])
    got[2].append(out.logits[1])
    rows = [[4, 5, 6], [12, 14], [8, 9, 10]]
    for i in range(3):
        _close(torch.stack(got[i]), alone[i][rows[i]])


def test_greedy_32_tokens() -> None:
    cfg, w = checkpoint("bf16", "tiny")
    hf = hf_reference("bf16", "tiny")
    prompt = _ids(11, seed=3)
    # Transformers, cached greedy decode, with the top-2 margin of every step.
    ids, margins = list(prompt), []
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
        for _ in range(32):
            top2 = out.logits[0, -1].topk(2).values
            margins.append((top2[0] - top2[1]).item())
            ids.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[ids[-1]]]), past_key_values=out.past_key_values,
                     use_cache=True)
    ref = ids[len(prompt):]
    runner = build_runner(cfg, w, num_pages=16)
    pages, toks = list(range(12)), list(prompt)
    seq = ScheduledSeq("g", list(prompt), 0, pages, 0, True, GREEDY)
    for _ in range(32):
        toks.append(runner.forward(Batch([seq])).next_tokens[0])
        seq = ScheduledSeq("g", [toks[-1]], len(toks) - 1, pages, 0, True, GREEDY)
    got = toks[len(prompt):]
    # Identical up to the first near-tie (after it the two may legitimately diverge).
    n = next((i for i, m in enumerate(margins) if m <= 1e-3), 32)
    assert n >= 8, f"too many near-ties in the reference ({margins[:n + 1]})"
    assert got[:n] == ref[:n]
