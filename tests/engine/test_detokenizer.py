from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyserve.engine.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Token id = one UTF-8 byte; 256 is a special token (dropped when skipping)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True) -> str:
        data = bytes(i for i in ids if i < 256)
        return data.decode("utf-8", errors="replace")


TOK = ByteTokenizer()
TEXTS = ["hello world", "naïve café — 你好，世界 🙂🙃 end", "Привет! \u00e9\u0301 a\u200db"]


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        pieces.append(detok.add(ids[i:i + n]))
        i += n
    pieces.append(detok.finish())
    return pieces


@pytest.mark.parametrize("text", TEXTS, ids=["ascii", "multibyte", "cyrillic"])
def test_stream_equals_full_decode_and_never_splits_chars(text: str) -> None:
    rng = random.Random(0)
    for _ in range(20):
        detok = IncrementalDetokenizer(TOK)
        pieces = stream(detok, TOK.encode(text), rng)
        assert "".join(pieces) == text == detok.text
        assert all("\ufffd" not in p for p in pieces)


def test_invalid_bytes_are_emitted_eventually() -> None:
    detok = IncrementalDetokenizer(TOK)
    out = detok.add([0xFF]) + detok.add([65]) + detok.finish()
    assert out == "\ufffdA"
    detok = IncrementalDetokenizer(TOK)
    assert detok.add([0xE4]) == ""  # may still complete
    assert detok.finish() == "\ufffd"


def test_special_tokens_skipped() -> None:
    detok = IncrementalDetokenizer(TOK)
    assert detok.add([72, 256, 73]) + detok.finish() == "HI"


@pytest.mark.parametrize("stops, text, expected", [
    (["STOP"], "abc STOP def", "abc "),
    (["STOP"], "abc STO", "abc STO"),  # flushed at the end: it never completed
    (["\n\n", "xyz"], "line\nmore\n\nrest", "line\nmore"),
    (["世界"], "你好世界!", "你好"),
    (["ab", "b"], "xxab", "xx"),  # the first to complete wins; ties: the longest
    (["a", " aa"], " aa", " "),
    (["aaa"], "aaaa", ""),
], ids=["simple", "partial_at_end", "two", "multibyte", "earliest", "first_complete", "at_start"])
def test_stop_strings(stops, text, expected) -> None:
    rng = random.Random(1)
    for _ in range(20):
        detok = IncrementalDetokenizer(TOK, stops)
        pieces = stream(detok, TOK.encode(text), rng)
        assert "".join(pieces) == expected == detok.text
        assert detok.stopped == (expected != text)
        assert (detok.matched is not None) == detok.stopped
        assert detok.matched is None or text[len(expected):].startswith(detok.matched)
        for s in stops:
            assert s not in "".join(pieces)


def test_holdback_releases_when_it_cannot_be_a_stop() -> None:
    detok = IncrementalDetokenizer(TOK, ["<END>"])
    assert detok.add(TOK.encode("a <E")) == "a "
    assert detok.add(TOK.encode("N")) == ""
    assert detok.add(TOK.encode("x")) == "<ENx"
    assert detok.add(TOK.encode("<END>tail")) == ""
    assert detok.stopped and detok.add([65]) == "" and detok.finish() == ""


def test_with_a_real_tokenizer() -> None:
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from tinyserve.testing.tokenizer import tokenizer_json
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json()))
    text = "Hello, 你好，世界。Привет 🙂 <think>x</think> done"
    ids = tok.encode(text)
    rng = random.Random(2)
    detok = IncrementalDetokenizer(tok, ["世界。П"])
    assert "".join(stream(detok, ids, rng)) == "Hello, 你好，"
    detok = IncrementalDetokenizer(tok)
    pieces = stream(detok, ids, rng)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


ALPHABET = "ab \n\u00e9\u4e16\U0001f642"


@settings(max_examples=200, deadline=None)
@given(text=st.text(ALPHABET, max_size=30), stops=st.lists(st.text(ALPHABET, min_size=1,
       max_size=4), max_size=3), seed=st.integers(0, 2**16))
def test_stop_strings_property(text: str, stops: list[str], seed: int) -> None:
    # the stop string that completes first, as if the text came one character at a time
    hits = [(i + len(s), i, s) for s in stops if (i := text.find(s)) >= 0]
    expected = text[:min(hits)[1]] if hits else text
    detok = IncrementalDetokenizer(TOK, stops)
    pieces = stream(detok, TOK.encode(text), random.Random(seed))
    assert "".join(pieces) == expected
    assert all("\ufffd" not in p for p in pieces)
    assert detok.stopped == bool(hits)
    assert detok.matched == (min(hits)[2] if hits else None)  # the string that stopped it


@pytest.mark.parametrize("clean_up", [False, True], ids=["backend", "wrapper"])
def test_fast_tokenizer_backend_decodes_like_the_wrapper(clean_up: bool) -> None:
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from tinyserve.engine.detokenizer import _decoder
    from tinyserve.testing.tokenizer import TINY_VOCAB_SIZE, tokenizer_json
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json()),
                                  clean_up_tokenization_spaces=clean_up)
    calls = []
    wrapped = tok.decode

    def counting_decode(ids, **kw):
        calls.append(1)
        return wrapped(ids, **kw)

    tok.decode = counting_decode
    rng = random.Random(3)
    fn = _decoder(tok)
    for _ in range(50):  # random ids: partial characters, special tokens, tags
        ids = [rng.randrange(TINY_VOCAB_SIZE) for _ in range(rng.randint(1, 6))]
        assert fn(ids) == wrapped(ids, skip_special_tokens=True)
    detok = IncrementalDetokenizer(tok)
    ids = [rng.randrange(TINY_VOCAB_SIZE) for _ in range(40)]
    assert "".join(stream(detok, ids, rng)) == wrapped(ids, skip_special_tokens=True)
    assert bool(calls) == clean_up  # the wrapper runs only when it post-processes
