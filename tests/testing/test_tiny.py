"""Tiny checkpoint factory: deterministic, fast, loadable by transformers, right layouts."""

from __future__ import annotations

import json

import pytest
import torch

from tinyserve.model.config import load_config
from tinyserve.testing.tiny import (
    TINY_CONFIG,
    TINY_CONFIG_HD128,
    make_tiny_checkpoint,
    tiny_text_config,
)
from tinyserve.testing.tokenizer import special_token_ids


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_deterministic_per_seed(tmp_path):
    a = make_tiny_checkpoint(tmp_path / "a", seed=3)
    b = make_tiny_checkpoint(tmp_path / "b", seed=3)
    c = make_tiny_checkpoint(tmp_path / "c", seed=4)
    assert _files(a) == _files(b)
    assert _files(a)["model.safetensors"] != _files(c)["model.safetensors"]


def test_rebuild_in_place_replaces_shards(tmp_path):
    from tinyserve.model.loader import CheckpointReader

    make_tiny_checkpoint(tmp_path / "x", fmt="bf16-official")
    make_tiny_checkpoint(tmp_path / "x", fmt="bf16")
    assert [f.name for f in CheckpointReader(tmp_path / "x").files] == ["model.safetensors"]
    assert not (tmp_path / "x" / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("fmt", ["bf16", "bf16-official"])
def test_transformers_loads_it_with_identical_logits(tiny_checkpoint, fmt):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 5, 70, 300, 499]])
    logits = []
    for f in ("bf16", fmt):
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(f), dtype=torch.float32)
        with torch.no_grad():
            logits.append(model(ids, use_cache=False).logits)
    assert logits[0].shape == (1, 5, 512)
    assert torch.isfinite(logits[0]).all()
    assert torch.equal(logits[0], logits[1])


def test_config_and_generation_files(tiny_checkpoint):
    path = tiny_checkpoint("bf16")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe_text" and "text_config" not in cfg
    ids = special_token_ids()
    c = load_config(path)
    assert c.eos_token_ids == (ids["<|endoftext|>"], ids["<|im_end|>"])
    assert c.vocab_size == TINY_CONFIG["vocab_size"] > max(ids.values())
    off = json.loads((tiny_checkpoint("bf16-official") / "config.json").read_text())
    assert off["model_type"] == "qwen3_5_moe" and "vision_config" in off
    assert off["text_config"]["partial_rotary_factor"] == 0.25


def test_hd128_config(tiny_checkpoint):
    path = tiny_checkpoint("bf16", **TINY_CONFIG_HD128)
    c = load_config(path)
    assert c.head_dim == 128 and c.head_dim % 128 == 0
    assert (c.linear_num_key_heads, c.linear_num_value_heads) == (2, 6)
    assert c.rotary_dim == 32
    rope = json.loads((path / "config.json").read_text())["rope_parameters"]
    assert sum(rope["mrope_section"]) == c.rotary_dim // 2


def test_overrides_follow_layer_count():
    cfg = tiny_text_config(num_hidden_layers=8)
    assert cfg["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert TINY_CONFIG["num_hidden_layers"] == 4  # the module constant is untouched


def test_unknown_format(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny checkpoint format 'fp16'"):
        make_tiny_checkpoint(tmp_path, fmt="fp16")


def test_vocab_too_small(tmp_path):
    with pytest.raises(ValueError, match="vocab_size 256 is too small"):
        make_tiny_checkpoint(tmp_path, vocab_size=256)
