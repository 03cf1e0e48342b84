"""The model on a CUDA GPU with its kernels (Triton GDN, NVFP4 GEMM, fused MoE): against
transformers on the CPU, against itself with the kernels off, chunked and batched."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.model.hf_tiny import build_runner, checkpoint, hf_reference
from tinyserve.core import SamplingParams, ScheduledSeq

pytestmark = [pytest.mark.requires_cuda,
              pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
CASES = [("tiny", "bf16"), ("tiny", "modelopt"), ("hd128", "bf16"), ("hd128", "modelopt")]


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _similar(got: torch.Tensor, ref: torch.Tensor, *, rel: float, agree: float) -> None:
    """Median per-token max |diff| within `rel` of the logit scale, argmax agreement."""
    got, ref = got.float().cpu(), ref.float().cpu()
    assert got.shape == ref.shape and torch.isfinite(got).all()
    scale = ref.abs().max().item()
    per_token = (got - ref).abs().max(-1).values
    assert per_token.median().item() <= rel * scale, (per_token.median().item(), scale)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= agree
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0)
    assert cos.item() > 0.999


@torch.no_grad()
def _hf_logits(fmt: str, geometry: str, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    hf = copy.deepcopy(hf_reference(fmt, geometry)).to(dtype)
    return hf(torch.tensor([ids]), use_cache=False).logits[0].float()


@pytest.mark.parametrize("geometry,fmt", CASES, ids=lambda x: str(x))
def test_bf16_cuda_vs_transformers_bf16(geometry: str, fmt: str) -> None:
    cfg, w = checkpoint(fmt, geometry)
    ids = _ids(70, seed=1)
    runner = build_runner(cfg, w, dtype=torch.bfloat16, device="cuda")
    got = runner.logits(ids)
    _similar(got, _hf_logits(fmt, geometry, ids, torch.bfloat16), rel=0.02, agree=0.85)


@pytest.mark.parametrize("geometry,fmt", CASES[:3], ids=lambda x: str(x))
def test_fp32_cuda_vs_transformers_fp32(geometry: str, fmt: str) -> None:
    cfg, w = checkpoint(fmt, geometry)
    ids = _ids(70, seed=2)
    runner = build_runner(cfg, w, dtype=torch.float32, device="cuda")
    _similar(runner.logits(ids), _hf_logits(fmt, geometry, ids, torch.float32), rel=5e-3,
             agree=0.95)


@pytest.mark.parametrize("geometry,fmt", CASES, ids=lambda x: str(x))
def test_kernels_vs_torch_references_on_cuda(geometry: str, fmt: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, w = checkpoint(fmt, geometry)
    ids = _ids(40, seed=3)
    fast = build_runner(cfg, w, dtype=torch.bfloat16, device="cuda").logits(ids)
    monkeypatch.setenv("TINYSERVE_DISABLE_KERNELS", "1")
    slow = build_runner(cfg, w, dtype=torch.bfloat16, device="cuda").logits(ids)
    _similar(fast, slow, rel=0.02, agree=0.85)


@pytest.mark.parametrize("geometry", ["tiny", "hd128"])
def test_chunked_prefill_decode_and_batch_on_cuda(geometry: str) -> None:
    """Chunks of 7 + decode steps of three sequences batched together equal the one-piece
    teacher-forced logits of each sequence alone (bf16, kernels on)."""
    cfg, w = checkpoint("bf16", geometry)
    prompts = [_ids(n, seed=20 + n) for n in (19, 5, 12)]
    extra = [_ids(4, seed=40 + i) for i in range(3)]
    alone = [build_runner(cfg, w, dtype=torch.bfloat16, device="cuda").logits(p + e)
             for p, e in zip(prompts, extra, strict=True)]
    runner = build_runner(cfg, w, dtype=torch.bfloat16, device="cuda", num_pages=40)
    pages = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    got: list[list[torch.Tensor]] = [[], [], []]
    pos = [0, 0, 0]
    while any(pos[i] < len(prompts[i]) + len(extra[i]) for i in range(3)):
        seqs, who = [], []
        for i in range(3):
            full = prompts[i] + extra[i]
            if pos[i] >= len(full):
                continue
            n = min(7, len(prompts[i]) - pos[i]) if pos[i] < len(prompts[i]) else 1
            seqs.append(ScheduledSeq(f"r{i}", full[pos[i]:pos[i] + n], pos[i], pages[i], i,
                                     sample=True, params=GREEDY))
            who.append((i, n))
        ctx = runner.prepare(seqs, all_logits=True)
        logits = runner.run(ctx)
        start = 0
        for i, n in who:
            got[i].append(logits[start:start + n])
            start += n
            pos[i] += n
    for i in range(3):
        _similar(torch.cat(got[i]), alone[i], rel=0.02, agree=0.9)
