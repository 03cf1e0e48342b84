"""Shared pieces of the offload tests: random NVFP4 experts (and their all-resident slots), a
step of random routing through a provider without host synchronisation, greedy generation
of one sequence."""

from __future__ import annotations

from typing import Any

import torch

from tinyserve.core import Batch, SamplingParams, ScheduledSeq
from tinyserve.kernels.moe.fused import ExpertSlots, fused_moe, pack_expert_slots
from tinyserve.kernels.nvfp4.ref import quantize_nvfp4

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def greedy_generate(runner: Any, prompt: list[int], n: int, chunk: int | None = None,
                    forced: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """Prefill `prompt` (in chunks of `chunk` tokens; one chunk when None) from position 0 in
    state slot 0 and KV pages 0..31, then decode greedily: (`n` tokens, their logits [n, V]
    fp32, copied: a graph's logits buffer is static). With `forced`, step i + 1 reads
    forced[i] instead of the token sampled at step i (teacher forcing)."""
    pages = list(range(32))
    step = chunk or len(prompt)
    out = None
    for start in range(0, len(prompt), step):
        part = prompt[start:start + step]
        seq = ScheduledSeq("r", part, start_pos=start, page_ids=pages, state_slot=0,
                           sample=start + len(part) == len(prompt), params=GREEDY)
        out = runner.forward(Batch([seq]))
    tokens, logits = [out.next_tokens[0]], [out.logits.float().clone()]
    for _ in range(n - 1):
        pos = len(prompt) + len(tokens) - 1
        last = tokens[-1] if forced is None else forced[len(tokens) - 1]
        seq = ScheduledSeq("r", [last], start_pos=pos, page_ids=pages, state_slot=0,
                           sample=True, params=GREEDY)
        out = runner.forward(Batch([seq]))
        tokens.append(out.next_tokens[0])
        logits.append(out.logits.float().clone())
    return tokens, torch.cat(logits)


def random_experts(L: int, E: int, H: int, F: int) -> dict:
    """NVFP4 gate/up/down weights of E experts in each of L layers, by checkpoint name."""
    g = torch.Generator().manual_seed(0)
    w = {}
    for layer in range(L):
        for e in range(E):
            p = f"layers.{layer}.mlp.experts.{e}"
            w[f"{p}.gate_proj"] = quantize_nvfp4(torch.randn(F, H, generator=g) * 0.05)
            w[f"{p}.up_proj"] = quantize_nvfp4(torch.randn(F, H, generator=g) * 0.05)
            w[f"{p}.down_proj"] = quantize_nvfp4(torch.randn(H, F, generator=g) * 0.05)
    return w


def resident_layers(w: dict, L: int, E: int) -> list[ExpertSlots]:
    """The experts of `w`, each layer packed into its own CUDA slots (slot = expert id)."""
    return [pack_expert_slots([(w[f"layers.{la}.mlp.experts.{e}.gate_proj"],
                                w[f"layers.{la}.mlp.experts.{e}.up_proj"],
                                w[f"layers.{la}.mlp.experts.{e}.down_proj"])
                               for e in range(E)], "cuda") for la in range(L)]


def step_without_sync(experts: Any, tokens: int, L: int, E: int, H: int, k: int,
                      g: torch.Generator) -> tuple[list, list, list, list]:
    """Random inputs, top-`k` routing and weights for each of `L` layers through
    `experts.forward`, with torch's sync debug mode turning any host synchronisation into an
    error: (xs, ids, weights, outputs), one entry per layer."""
    xs = [torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=g)
          for _ in range(L)]
    ids = [torch.rand(tokens, E, device="cuda", generator=g).topk(k).indices for _ in range(L)]
    wts = [torch.rand(tokens, k, device="cuda", generator=g) for _ in range(L)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [experts.forward(la, xs[la], ids[la], wts[la]) for la in range(L)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return xs, ids, wts, outs


def assert_resident_outputs(outs: list, xs: list, ids: list, wts: list,
                            resident: list[ExpertSlots]) -> None:
    """Each layer's output equals the fused MoE over the resident slots. Same weights, same
    kernel; only the slot numbering (and so the tiling of the prefill path) differs, so bf16
    rounding is allowed."""
    for la, out in enumerate(outs):
        ref = fused_moe(xs[la], ids[la], wts[la], resident[la]).float()
        torch.testing.assert_close(out.float(), ref, rtol=1e-2,
                                   atol=1e-2 * ref.abs().max().item())
