"""quantize_checkpoint / `tinyserve quantize`: output loads back and equals the in-memory
quantizer bit for bit, the recipe picks the right layers, configs and side files are written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tinyserve.cli import main as cli_main
from tinyserve.core import DenseWeight, FP8Weight, NVFP4Weight
from tinyserve.kernels.nvfp4.ref import quantize_fp8, quantize_nvfp4
from tinyserve.model.config import load_config
from tinyserve.model.loader import CheckpointReader
from tinyserve.model.loader import load_weights as _load_weights
from tinyserve.model.quantize import quantize_checkpoint, weight_format


def load_weights(path, config) -> dict:
    """The checkpoint's own linears (no fused same-input linears): compared name by name."""
    return _load_weights(path, config, fuse=False)


def _assert_matches_quantizer(quantized: dict, source: dict, *, gdn: bool = False,
                              recipe: str = "nvfp4") -> int:
    n = 0
    for name, src in source.items():
        got = quantized[name]
        kind = weight_format(name, recipe=recipe, quantize_gdn=gdn)
        if isinstance(src, DenseWeight) and kind == "fp8":
            want = quantize_fp8(src.weight)
            assert isinstance(got, FP8Weight), name
            assert torch.equal(got.weight, want.weight) and torch.equal(got.scale, want.scale)
            n += 1
        elif isinstance(src, DenseWeight) and kind == "nvfp4":
            want = quantize_nvfp4(src.weight)
            assert isinstance(got, NVFP4Weight), name
            assert torch.equal(got.packed, want.packed), name
            assert torch.equal(got.block_scale, want.block_scale), name
            assert got.global_scale == want.global_scale, name
            n += 1
        elif isinstance(src, DenseWeight):
            assert isinstance(got, DenseWeight) and torch.equal(got.weight, src.weight), name
        else:
            assert torch.equal(got, src), name
    return n


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_round_trip_bit_exact(tiny_checkpoint, tmp_path, fmt):
    src = tiny_checkpoint("bf16")
    dst = quantize_checkpoint(src, tmp_path / fmt, fmt)
    cfg = load_config(dst)
    assert cfg.quant.method == fmt
    source = load_weights(src, load_config(src))
    n = _assert_matches_quantizer(load_weights(dst, cfg), source)
    assert n == 4 * (8 * 3 + 3) + 4  # experts + shared experts per layer, q/k/v/o
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / f).read_bytes() == (src / f).read_bytes()
    assert (dst / "hf_quant_config.json").is_file() == (fmt == "modelopt")


def test_modelopt_config_and_tensors(tiny_checkpoint, tmp_path):
    dst = quantize_checkpoint(tiny_checkpoint("bf16"), tmp_path / "mo", "modelopt")
    q = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert (q["quant_method"], q["quant_algo"]) == ("modelopt", "NVFP4")
    hf = json.loads((dst / "hf_quant_config.json").read_text())["quantization"]
    assert hf["quant_algo"] == "NVFP4" and hf["group_size"] == 16
    assert "model.layers.0.linear_attn*" in hf["exclude_modules"]
    assert "model.layers.3.mlp.gate" in hf["exclude_modules"]
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        p = "model.layers.1.mlp.experts.2.up_proj."
        assert f.get_slice(p + "weight").get_dtype() == "U8"
        assert f.get_slice(p + "weight_scale").get_dtype() == "F8_E4M3"
        assert f.get_slice(p + "weight_scale_2").get_shape() == []
        assert f.get_slice("model.layers.0.linear_attn.in_proj_qkv.weight").get_dtype() == "BF16"


def test_compressed_tensors_config_and_tensors(tiny_checkpoint, tmp_path):
    dst = quantize_checkpoint(tiny_checkpoint("bf16"), tmp_path / "ct", "compressed-tensors")
    q = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert (q["quant_method"], q["format"]) == ("compressed-tensors", "nvfp4-pack-quantized")
    assert q["config_groups"]["group_0"]["weights"]["group_size"] == 16
    assert "re:.*linear_attn.*" in q["ignore"]
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        p = "model.layers.3.self_attn.q_proj."
        assert f.get_slice(p + "weight_packed").get_shape() == [256, 32]
        gs = f.get_tensor(p + "weight_global_scale")
        assert gs.shape == (1,) and gs.dtype == torch.float32
        assert p + "weight" not in f.keys()


def test_fused_source_quantizes_per_expert(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("bf16-official")
    dst = quantize_checkpoint(src, tmp_path / "off", "modelopt", max_shard_bytes=100_000)
    reader = CheckpointReader(dst)
    assert len(reader.files) > 1 and (dst / "model.safetensors.index.json").is_file()
    names = reader.names()
    assert "model.language_model.layers.0.mlp.experts.5.down_proj.weight" in names
    assert not any(n.endswith("gate_up_proj") and not n.startswith("mtp.") for n in names)
    assert any(n.startswith("model.visual.") for n in names)  # copied through
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in names
    assert load_config(dst).quant.method == "modelopt"
    source = load_weights(src, load_config(src))
    _assert_matches_quantizer(load_weights(dst, load_config(dst)), source)


def test_quantize_gdn_option(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("bf16")
    dst = quantize_checkpoint(src, tmp_path / "gdn", "compressed-tensors", quantize_gdn=True)
    w = load_weights(dst, load_config(dst))
    assert isinstance(w["layers.0.linear_attn.in_proj_qkv"], NVFP4Weight)
    assert isinstance(w["layers.0.linear_attn.out_proj"], NVFP4Weight)
    assert isinstance(w["layers.0.linear_attn.in_proj_a"], DenseWeight)
    _assert_matches_quantizer(w, load_weights(src, load_config(src)), gdn=True)


def test_mixed_recipe_round_trip(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("bf16")
    dst = quantize_checkpoint(src, tmp_path / "mixed", "modelopt", recipe="mixed")
    cfg = load_config(dst)
    assert (cfg.quant.method, cfg.quant.algo) == ("modelopt", "MIXED_PRECISION")
    hf = json.loads((dst / "hf_quant_config.json").read_text())["quantization"]
    layers = {k: v["quant_algo"] for k, v in hf["quantized_layers"].items()}
    assert layers["model.layers.0.mlp.experts"] == "W4A16_NVFP4"
    assert layers["lm_head"] == "W4A16_NVFP4"
    assert layers["model.layers.3.self_attn.q_proj"] == "FP8"
    assert layers["model.layers.0.linear_attn.in_proj_z"] == "FP8"
    assert "model.layers.0.linear_attn.in_proj_a" not in layers
    w = load_weights(dst, cfg)
    n = _assert_matches_quantizer(w, load_weights(src, load_config(src)), recipe="mixed")
    assert n == 4 * (8 * 3 + 3) + 1 + 3 * 3 + 4
    with pytest.raises(ValueError, match="unknown recipe 'mixed' for compressed-tensors"):
        quantize_checkpoint(src, tmp_path / "x", "compressed-tensors", recipe="mixed")


def test_tied_lm_head_stays_the_embedding(tmp_path):
    """A tied checkpoint without lm_head.weight: the mixed recipe quantizes lm_head, but a tied
    lm_head is the embedding, which stays in the model dtype (and the output loads)."""
    from tinyserve.testing.tiny import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "tied", tie_word_embeddings=True,
                               transform=lambda sd: {k: v for k, v in sd.items()
                                                     if k != "lm_head.weight"})
    dst = quantize_checkpoint(src, tmp_path / "mixed", "modelopt", recipe="mixed")
    hf = json.loads((dst / "hf_quant_config.json").read_text())["quantization"]
    assert "lm_head" not in hf["quantized_layers"]
    w = load_weights(dst, load_config(dst))
    source = load_weights(src, load_config(src))
    assert torch.equal(w["embed_tokens"], source["embed_tokens"])
    assert isinstance(w["lm_head"], DenseWeight)
    assert torch.equal(w["lm_head"].weight, source["embed_tokens"])


def test_recipe():
    yes = ["layers.0.mlp.experts.3.gate_proj", "layers.0.mlp.shared_expert.down_proj",
           "layers.3.self_attn.q_proj", "layers.3.self_attn.o_proj"]
    no = ["layers.0.mlp.gate", "layers.0.mlp.shared_expert_gate", "lm_head",
          "layers.0.linear_attn.in_proj_qkv", "layers.0.linear_attn.in_proj_b"]
    assert all(weight_format(n) == "nvfp4" for n in yes)
    assert not any(weight_format(n) == "nvfp4" for n in no)
    assert weight_format("layers.0.linear_attn.out_proj", quantize_gdn=True) == "nvfp4"
    assert weight_format("layers.0.linear_attn.in_proj_a", quantize_gdn=True) != "nvfp4"


def test_cli(tiny_checkpoint, tmp_path, capsys):
    src = tiny_checkpoint("bf16")
    rc = cli_main(["quantize", str(src), str(tmp_path / "out"), "--format",
                   "compressed-tensors"])
    assert rc == 0 and "compressed-tensors" in capsys.readouterr().out
    assert load_config(tmp_path / "out").quant.method == "compressed-tensors"
    rc = cli_main(["quantize", str(tmp_path / "out"), str(tmp_path / "again")])
    assert rc == 2
    assert "already quantized" in capsys.readouterr().err


def test_errors(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("bf16")
    with pytest.raises(ValueError, match="unknown format 'gptq'"):
        quantize_checkpoint(src, tmp_path / "x", "gptq")
    with pytest.raises(ValueError, match="must differ from the source"):
        quantize_checkpoint(src, src, "modelopt")
    dst = quantize_checkpoint(src, tmp_path / "once", "modelopt")
    with pytest.raises(ValueError) as err:
        quantize_checkpoint(src, dst, "modelopt")
    assert str(err.value) == (f"{dst}: already holds a checkpoint (model.safetensors); use an "
                              f"empty output directory")
    quantize_checkpoint(src, dst, "compressed-tensors", overwrite=True)
    assert load_config(dst).quant.method == "compressed-tensors"
