"""Greedy generation of one sequence through a `ModelRunner`, for the offload tests."""

from __future__ import annotations

from typing import Any

import torch

from tinyserve.core import Batch, SamplingParams, ScheduledSeq

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
