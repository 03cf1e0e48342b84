"""Tiny checkpoint factory for tests, `tinyserve demo` and benchmarks."""

from __future__ import annotations

from tinyserve.testing.tiny import (
    FORMATS,
    TINY_CONFIG,
    TINY_CONFIG_HD128,
    make_tiny_checkpoint,
    random_state_dict,
    tiny_text_config,
)
from tinyserve.testing.tokenizer import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TINY_VOCAB_SIZE,
    save_tiny_tokenizer,
    special_token_ids,
)

__all__ = [
    "CHAT_TEMPLATE",
    "FORMATS",
    "SPECIAL_TOKENS",
    "TINY_CONFIG",
    "TINY_CONFIG_HD128",
    "TINY_VOCAB_SIZE",
    "make_tiny_checkpoint",
    "random_state_dict",
    "save_tiny_tokenizer",
    "special_token_ids",
    "tiny_text_config",
]
