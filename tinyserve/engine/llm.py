"""The offline API: `LLM(model).generate(prompts, params)`, a thin layer over the Engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tinyserve.core import SamplingParams, TokenLogprobs
from tinyserve.engine.build import build_engine
from tinyserve.engine.config import EngineConfig
from tinyserve.engine.loop import Engine

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class Completion:
    """One finished generation."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # with params.logprobs set


class LLM:
    """Load a checkpoint and generate offline. `kv`, `device`, `max_context`, `max_seqs`,
    `gpu_memory` and `engine_kwargs` are `EngineConfig` fields (None keeps the default); the plan
    is `tinyserve run`'s. Raises ValueError / FileNotFoundError on unusable settings."""

    def __init__(self, model: str, *, kv: str | None = None, device: str | None = None,
                 max_context: int | None = None, max_seqs: int | None = None,
                 gpu_memory: str | int | None = None, **engine_kwargs: Any) -> None:
        given = dict(kv=kv, device=device, max_context=max_context, max_seqs=max_seqs,
                     gpu_memory=gpu_memory, **engine_kwargs)
        config = EngineConfig(model=str(model), **{k: v for k, v in given.items()
                                                   if v is not None})
        self.engine: Engine = build_engine(config).start()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return [int(t) for t in prompt]

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[Completion]:
        """Generate for every prompt (strings or token-id lists), batched together; `params`
        is one SamplingParams for all or one per prompt. Raises RequestRejected before anything runs
        when a prompt can never fit."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt
        encoded = [self.encode(p) for p in prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(encoded)
        if len(params) != len(encoded):
            raise ValueError(f"{len(params)} sampling params for {len(encoded)} prompts")
        for ids, p in zip(encoded, params, strict=True):
            self.engine.scheduler.check(len(ids), p)
        handles = [self.engine.submit(ids, p) for ids, p in zip(encoded, params, strict=True)]
        try:
            outs = [h.result() for h in handles]
        except BaseException:
            for h in handles:
                h.abort()
            raise
        return [Completion(ids, o.token_ids, o.text, o.finish_reason, o.error, o.logprobs)
                for ids, o in zip(encoded, outs, strict=True)]

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits float32 [T, V] on the CPU."""
        return self.engine.logits(token_ids).float().cpu()

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
