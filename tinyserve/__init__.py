"""tinyserve: a single-process inference server for NVFP4 Qwen3.5-MoE on small-VRAM GPUs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tinyserve.core import SamplingParams

if TYPE_CHECKING:
    from tinyserve.engine.llm import LLM, Completion

__all__ = ["LLM", "Completion", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The engine (and torch model code) loads only when asked for.
    if name in ("LLM", "Completion"):
        from tinyserve.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'tinyserve' has no attribute {name!r}")
