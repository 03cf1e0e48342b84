"""A tiny byte-level BPE tokenizer with Qwen3.5's special tokens and a Qwen3.5-style chat template.

`save_tiny_tokenizer(path)` writes tokenizer.json, tokenizer_config.json (chat template, eos
`<|im_end|>`) and chat_template.jinja so that `transformers.AutoTokenizer.from_pretrained(path)`
works offline. The BPE merges are learned deterministically from a fixed text; the vocabulary
is 256 byte tokens + merges + the special tokens, TINY_VOCAB_SIZE ids in all.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

# Regular tokens first (bytes, then merges), the special tokens at the end, as in Qwen3.5.
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
)
# Special in the skip_special_tokens sense; the think and tool tags are kept on decode.
_HIDDEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_VOCAB_SIZE = 500  # must fit the tiny model's vocab_size (512)
# Qwen3.5's chat template for text: same rendering of system / user / assistant / tool
# messages, reasoning_content, tool calls (XML form), tools and the enable_thinking switch.
CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text()

_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. Hello, how are you? I am fine, thank you.
You are a helpful assistant. What is the weather like today in Paris? It is sunny and warm.
def main():\n    print("hello world")\n    return 0\n
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>
The user asks a question and the assistant thinks about the answer before it replies.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 42. Tokens, text, model, server, request.
Une phrase en français. Ein Satz auf Deutsch. 你好，世界。こんにちは。Привет, мир!
"""


@cache
def tokenizer_json() -> str:
    """The serialized tokenizer (tokenizers library JSON), built once per process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_TRAINING_TEXT.splitlines(keepends=True) * 2, trainer=trainer)
    from tokenizers import AddedToken

    # NOTE: add_special_tokens marks every token special; the tags go through add_tokens so
    # that decode(skip_special_tokens=True) keeps them, as the real Qwen3.5 tokenizer does.
    # SPECIAL_TOKENS lists the hidden ones first, so the ids are unchanged.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKENS if t in _HIDDEN_SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in SPECIAL_TOKENS if t not in _HIDDEN_SPECIALS])
    return tok.to_str()


def special_token_ids() -> dict[str, int]:
    """Id of each special token in the tiny vocabulary."""
    data = json.loads(tokenizer_json())
    return {t["content"]: t["id"] for t in data["added_tokens"]}


def save_tiny_tokenizer(path: str | Path) -> dict[str, int]:
    """Write the tiny tokenizer files into directory `path`; returns the special token ids."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tokenizer_json())
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    config = {
        "backend": "tokenizers",
        "tokenizer_class": "TokenizersBackend",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "model_max_length": 262144,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return special_token_ids()
