"""load_config: flat and nested configs, layer_types vs interval, rope fields, EOS ids,
quantization info, and one-sentence errors naming the file and field."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tinyserve.model.config import ConfigError, ModelConfig, QuantConfig, load_config
from tinyserve.testing.tiny import tiny_text_config


def _write(dir: Path, name: str, data: dict) -> Path:
    dir.mkdir(parents=True, exist_ok=True)
    (dir / name).write_text(json.dumps(data))
    return dir


def _flat(**changes) -> dict:
    cfg = {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
           **tiny_text_config(), "eos_token_id": 491}
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


QWEN35_35B_TEXT = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048,
    "num_hidden_layers": 40, "full_attention_interval": 4,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144, "eos_token_id": 248044, "attn_output_gate": True,
    "mamba_ssm_dtype": "float32", "mtp_num_hidden_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                        "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                        "mrope_interleaved": True},
}


def test_defaults_describe_qwen35_35b():
    c = ModelConfig()
    assert c.rotary_dim == 64
    assert c.full_attention_layers == tuple(range(3, 40, 4))
    assert len(c.linear_attention_layers) == 30
    assert (c.linear_key_dim, c.linear_value_dim, c.linear_conv_dim) == (2048, 4096, 8192)
    assert c.num_attention_heads // c.num_kv_heads == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 1  # type: ignore[misc]


def test_nested_official_config(tmp_path):
    root = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "tie_word_embeddings": False, "image_token_id": 248056,
            "text_config": QWEN35_35B_TEXT, "vision_config": {"depth": 27, "hidden_size": 1152}}
    _write(tmp_path, "config.json", root)
    _write(tmp_path, "generation_config.json", {"eos_token_id": [248046, 248044]})
    c = load_config(tmp_path)
    assert c == dataclasses.replace(ModelConfig(), eos_token_ids=(248044, 248046))
    assert load_config(tmp_path / "config.json") == c  # a file path works too


def test_flat_tiny_config(tmp_path):
    c = load_config(_write(tmp_path, "config.json", _flat()))
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.head_dim) == (512, 64, 4, 32)
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (c.num_attention_heads, c.num_kv_heads, c.rotary_dim) == (4, 2, 8)
    assert (c.linear_num_key_heads, c.linear_num_value_heads) == (2, 4)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 64)
    assert c.rope_theta == 1e7 and c.eos_token_ids == (491,)
    assert c.quant == QuantConfig() and not c.quant.is_quantized


def test_interval_builds_layer_types(tmp_path):
    cfg = _flat(layer_types=None, num_hidden_layers=6, full_attention_interval=3)
    c = load_config(_write(tmp_path, "config.json", cfg))
    assert c.full_attention_layers == (2, 5)
    c = load_config(_write(tmp_path, "config.json", _flat(layer_types=None)))
    assert c.full_attention_layers == (3,)  # interval defaults to 4


def test_rope_fields_at_top_level_and_defaults(tmp_path):
    cfg = _flat(rope_parameters=None, partial_rotary_factor=0.5, rope_theta=5e5)
    c = load_config(_write(tmp_path, "config.json", cfg))
    assert (c.partial_rotary_factor, c.rotary_dim, c.rope_theta) == (0.5, 16, 5e5)
    c = load_config(_write(tmp_path, "config.json", _flat(rope_parameters=None)))
    assert (c.rope_theta, c.partial_rotary_factor) == (10000.0, 0.25)  # transformers defaults
    cfg = _flat(rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                partial_rotary_factor=0.5)
    c = load_config(_write(tmp_path, "config.json", cfg))
    assert (c.rope_theta, c.rotary_dim) == (1e6, 16)


def test_eos_ids_union_in_order(tmp_path):
    _write(tmp_path, "config.json", _flat(eos_token_id=[7, 3]))
    _write(tmp_path, "generation_config.json", {"eos_token_id": [3, 9, 7]})
    assert load_config(tmp_path).eos_token_ids == (7, 3, 9)


def test_modelopt_quant_info(tmp_path):
    q = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}
    _write(tmp_path, "config.json", _flat(quantization_config=q))
    hf = {"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8", "group_size": 16,
        "exclude_modules": ["lm_head", "mtp*"],
        "quantized_layers": {"model.layers.0.mlp.experts": {"quant_algo": "W4A16_NVFP4",
                                                            "group_size": 16},
                             "model.layers.3.self_attn.q_proj": {"quant_algo": "FP8"}}}}
    _write(tmp_path, "hf_quant_config.json", hf)
    c = load_config(tmp_path).quant
    assert (c.method, c.algo) == ("modelopt", "MIXED_PRECISION")


def test_compressed_tensors_quant_info(tmp_path):
    q = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
         "ignore": ["lm_head", "re:.*mlp.gate$"]}
    c = load_config(_write(tmp_path, "config.json", _flat(quantization_config=q))).quant
    assert (c.method, c.algo) == ("compressed-tensors", "nvfp4-pack-quantized")


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "llama"},
     "config.json: model_type 'llama' is not supported (expected one of qwen3_5_moe, "
     "qwen3_5_moe_text)"),
    ({"hidden_size": None}, "config.json: field 'hidden_size' is missing"),
    ({"num_experts": "8"}, "config.json: field 'num_experts' must be an integer, got '8'"),
    ({"num_key_value_heads": 3},
     "config.json: field 'num_key_value_heads' (3) must divide num_attention_heads (4)"),
    ({"layer_types": ["linear_attention"] * 3},
     "config.json: field 'layer_types' has 3 entries for num_hidden_layers=4"),
    ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]},
     "config.json: field 'layer_types' has unknown layer type 'sliding_attention'"),
    ({"num_experts_per_tok": 9}, "config.json: field 'num_experts_per_tok' (9) exceeds "
                                 "num_experts (8)"),
    ({"linear_num_value_heads": 3}, "config.json: field 'linear_num_value_heads' (3) must be a "
                                    "multiple of linear_num_key_heads (2)"),
    ({"vocab_size": 0}, "config.json: field 'vocab_size' must be >= 1, got 0"),
    ({"rope_parameters": {"rope_theta": "big"}},
     "config.json: field 'rope_theta' must be a number, got 'big'"),
    ({"eos_token_id": 9999}, "config.json: field 'eos_token_id' [9999] is outside the "
                             "vocabulary (vocab_size 512)"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}},
     "config.json: quantization_config.quant_method 'gptq' is not supported (expected "
     "modelopt or compressed-tensors)"),
], ids=["model_type", "missing", "type", "kv_heads", "layer_count", "layer_kind", "topk",
        "value_heads", "vocab", "rope_theta", "eos", "quant_method"])
def test_config_errors(tmp_path, changes, message):
    _write(tmp_path, "config.json", _flat(**changes))
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    assert str(err.value) == f"{tmp_path / message}"
    assert "\n" not in str(err.value)


def test_nested_errors_name_text_config(tmp_path):
    text = {**QWEN35_35B_TEXT, "num_key_value_heads": 5}
    _write(tmp_path, "config.json", {"model_type": "qwen3_5_moe", "text_config": text})
    with pytest.raises(ConfigError, match=r"config\.json: text_config: field "
                                          r"'num_key_value_heads' \(5\) must divide"):
        load_config(tmp_path)


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match=r"config\.json: file not found$"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        load_config(tmp_path)
    _write(tmp_path, "config.json", _flat(quantization_config={"quant_method": "modelopt"}))
    _write(tmp_path, "hf_quant_config.json", {"quantization": {"quant_algo": "W4A8_AWQ"}})
    with pytest.raises(ConfigError, match=r"hf_quant_config\.json: quant_algo 'W4A8_AWQ' is not "
                                          r"supported"):
        load_config(tmp_path)


def test_quant_config_leniency_and_formats(tmp_path):
    # ModelOpt without any quant_algo: the tensors decide
    _write(tmp_path, "config.json", _flat(quantization_config={"quant_method": "modelopt"}))
    assert load_config(tmp_path).quant == QuantConfig(method="modelopt")
    q = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    _write(tmp_path, "config.json", _flat(quantization_config=q))
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    assert str(err.value) == (f"{tmp_path}/config.json: quantization_config.format "
                              f"'pack-quantized' is not supported (expected one of "
                              f"nvfp4-pack-quantized, float-quantized, naive-quantized, "
                              f"mixed-precision)")
