"""Fixtures of the server tests: the real Qwen3.5 tokenizer (from /work/shared)."""

from __future__ import annotations

import lzma
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(shared_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = shared_dir / "data" / "qwen35_tokenizer" / "hf"
    if not (src / "tokenizer.json.xz").is_file():
        pytest.skip("the Qwen3.5 tokenizer files are missing")
    dst = tmp_path_factory.mktemp("qwen35_tokenizer")
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / name, dst / name)
    with lzma.open(src / "tokenizer.json.xz") as f:
        (dst / "tokenizer.json").write_bytes(f.read())
    return dst


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))
