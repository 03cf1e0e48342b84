"""Shared pieces of the offload tests: random NVFP4 experts, a CPU runner of the tiny model,
greedy generation of one sequence."""

from __future__ import annotations

from typing import Any

import torch

from tinyserve.core import Batch, SamplingParams, ScheduledSeq
from tinyserve.engine.runner import ModelRunner
from tinyserve.kernels.nvfp4_ref import quantize_nvfp4
from tinyserve.kv.bf16 import BF16KVBackend
from tinyserve.kv.state_pool import GDNStatePool
from tinyserve.model.qwen35 import Qwen35Model

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def greedy_generate(runner: Any, prompt: list[int], n: int, chunk: int | None = None
                    ) -> tuple[list[int], torch.Tensor]:
    """Prefill `prompt` (in chunks of `chunk` tokens; one chunk when None) from position 0 in
    state slot 0 and KV pages 0..31, then decode greedily: (`n` tokens, their logits [n, V]
    fp32, copied: a graph's logits buffer is static)."""
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
        seq = ScheduledSeq("r", [tokens[-1]], start_pos=pos, page_ids=pages, state_slot=0,
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


def cpu_runner(cfg: Any, weights: dict, experts: Any = None) -> ModelRunner:
    """The model on CPU in fp32 over NaN-filled KV pages and GDN states (32 pages of 4 tokens,
    2 state slots); with `experts` the model gets no expert weights of its own."""
    kv = BF16KVBackend(layer_ids=list(cfg.full_attention_layers), num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, num_pages=32, page_size=4, device="cpu",
                       dtype=torch.float32)
    states = GDNStatePool.for_config(cfg, 2, device="cpu", dtype=torch.float32)
    for t in (kv.k_cache, kv.v_cache, states.conv, states.recurrent):
        t.fill_(float("nan"))
    if experts is not None:  # the model must not need the expert weights
        weights = {k: v for k, v in weights.items() if ".mlp.experts." not in k}
    model = Qwen35Model(cfg, weights, kv=kv, states=states, experts=experts, device="cpu",
                        dtype=torch.float32)
    return ModelRunner(model, page_size=4)
