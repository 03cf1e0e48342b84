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


# Qwen3.5's chat template for text: same rendering of system / user / assistant / tool messages,
# reasoning_content, tool calls (XML form), tools and the enable_thinking switch.
CHAT_TEMPLATE = r"""{%- macro render_content(content) %}
    {%- if content is string %}{{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if 'text' in item %}{{- item.text }}
            {%- else %}{{- raise_exception('Only text content is supported.') }}{%- endif %}
        {%- endfor %}
    {%- elif content is none or content is undefined %}{{- '' }}
    {%- else %}{{- raise_exception('Unexpected content type.') }}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}{{- raise_exception('No messages provided.') }}{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content)|trim %}
        {%- if content %}{{- '\n\n' + content }}{%- endif %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {%- set content = render_content(messages[0].content)|trim %}
    {{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set content = render_content(message.content)|trim %}
        {%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}{{- raise_exception('No user query found in messages.') }}{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content)|trim %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}{{- raise_exception('System message must be at the beginning.') }}{%- endif %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content|trim %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
                {%- if loop.first %}
                    {%- if content|trim %}{{- '\n\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- else %}{{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}{%- endif %}
                {%- else %}
                    {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- endif %}
                {%- if tool_call.arguments is defined %}
                    {%- for args_name, args_value in tool_call.arguments|items %}
                        {{- '<parameter=' + args_name + '>\n' }}
                        {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                        {{- args_value }}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}{{- '<|im_end|>\n' }}
        {%- elif loop.last %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}
    {%- else %}{{- '<think>\n' }}{%- endif %}
{%- endif %}
"""  # noqa: E501
