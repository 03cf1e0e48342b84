"""Checkpoint loader: every tiny format loads to the saved weights, layouts and prefixes agree,
storage follows the tensors present, and each error is one exact line naming file and tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tinyserve.core import DenseWeight, FP8Weight, NVFP4Weight
from tinyserve.kernels.nvfp4.ref import dequantize_fp8, dequantize_nvfp4, quantize_fp8
from tinyserve.model.config import ConfigError, load_config
from tinyserve.model.loader import (
    CheckpointError,
    CheckpointReader,
    iter_weights,
    load_weights,
    parse_expert_name,
    resolve_model_path,
)
from tinyserve.model.loader_plan import expected_weights, plan_weights

FMTS = ("bf16", "bf16-official", "modelopt", "compressed-tensors", "modelopt-mixed")


def _dense(v) -> torch.Tensor:
    if isinstance(v, NVFP4Weight):
        return dequantize_nvfp4(v)
    if isinstance(v, FP8Weight):
        return dequantize_fp8(v)
    return (v.weight if isinstance(v, DenseWeight) else v).float()


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(ckpt: Path, fn) -> None:
    """Rewrite the single model.safetensors of `ckpt` through fn(dict) -> dict."""
    file = ckpt / "model.safetensors"
    tensors = load_file(file)
    save_file(fn(tensors), file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def bf16_weights(tiny_checkpoint):
    path = tiny_checkpoint("bf16")
    return load_weights(path, load_config(path), fuse=False)


@pytest.mark.parametrize("fmt", FMTS)
def test_every_format_loads_the_saved_weights(tiny_checkpoint, bf16_weights, fmt):
    path = tiny_checkpoint(fmt)
    cfg = load_config(path)
    weights = load_weights(path, cfg, fuse=False)  # (the fused ones: test_fused_linears.py)
    assert set(weights) == set(expected_weights(cfg))
    quantized = 0
    for name, ref in bf16_weights.items():
        got = weights[name]
        if isinstance(got, (NVFP4Weight, FP8Weight)):
            quantized += 1
            err = (_dense(got) - _dense(ref)).norm() / _dense(ref).norm()
            assert err < (0.15 if isinstance(got, NVFP4Weight) else 0.05), name
        else:
            assert type(got) is type(ref), name
            assert torch.equal(_dense(got), _dense(ref)), name
    nvfp4 = 4 * (8 * 3 + 3) + 4
    assert quantized == {"modelopt-mixed": nvfp4 + 1 + 9}.get(fmt, 0 if "bf16" in fmt else nvfp4)


def test_canonical_forms(bf16_weights):
    w = bf16_weights
    assert w["embed_tokens"].shape == (512, 64) and w["embed_tokens"].dtype == torch.float32
    assert isinstance(w["lm_head"], DenseWeight) and w["lm_head"].shape == (512, 64)
    assert w["layers.0.linear_attn.conv1d"].shape == (128, 4)
    for n in ("A_log", "dt_bias", "norm"):
        assert w[f"layers.0.linear_attn.{n}"].dtype == torch.float32
    assert isinstance(w["layers.1.mlp.experts.7.down_proj"], DenseWeight)
    assert w["layers.1.mlp.experts.7.down_proj"].shape == (64, 64)
    assert w["layers.3.self_attn.q_proj"].shape == (256, 64)
    # norms were randomised: not the zero init
    assert w["layers.0.input_layernorm"].abs().max() > 0
    assert not torch.equal(w["layers.0.linear_attn.norm"], torch.ones(16))


def test_dtype_and_precision_rules(tiny_checkpoint):
    path = tiny_checkpoint("bf16")
    w = load_weights(path, load_config(path), dtype=torch.bfloat16)
    assert w["embed_tokens"].dtype == torch.bfloat16
    assert w["layers.0.mlp.gate"].weight.dtype == torch.bfloat16
    assert w["layers.0.linear_attn.A_log"].dtype == torch.float32
    assert w["layers.0.linear_attn.norm"].dtype == torch.float32
    # A_log is stored F32 in the checkpoint: it keeps its fp32 bits
    raw = CheckpointReader(path).get("model.layers.0.linear_attn.A_log")
    assert raw.dtype == torch.float32 and torch.equal(w["layers.0.linear_attn.A_log"], raw)


def test_fused_and_per_expert_layouts_agree(tiny_checkpoint):
    a, b = tiny_checkpoint("bf16"), tiny_checkpoint("bf16-official")
    wa, wb = load_weights(a, load_config(a)), load_weights(b, load_config(b))
    assert set(wa) == set(wb)
    for name in wa:
        assert torch.equal(_dense(wa[name]), _dense(wb[name])), name


def test_official_layout_is_sharded_and_skips_vision_and_mtp(tiny_checkpoint):
    path = tiny_checkpoint("bf16-official")
    reader = CheckpointReader(path)
    assert len(reader.files) > 1
    names = reader.names()
    assert any(n.startswith("model.visual.") for n in names)
    assert any(n.startswith("mtp.") for n in names)
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in reader.names()
    assert reader.tensor_info("model.language_model.layers.0.mlp.experts.gate_up_proj") == (
        torch.bfloat16, (8, 128, 64))


def test_iteration_is_in_file_order_and_can_skip_experts(tiny_checkpoint):
    path = tiny_checkpoint("bf16-official")
    cfg = load_config(path)
    reader = CheckpointReader(path)
    plans = plan_weights(reader, cfg)
    orders = [p.order for p in plans]
    assert orders == sorted(orders)
    names = [n for n, _ in iter_weights(reader, cfg, include_experts=False, fuse=False)]
    assert not any(parse_expert_name(n) for n in names)
    assert len(names) == len(expected_weights(cfg)) - 4 * 8 * 3
    full = [n for n, _ in iter_weights(reader, cfg)]
    layers = [parse_expert_name(n)[0] for n in full if parse_expert_name(n)]
    assert layers == sorted(layers)  # experts arrive layer by layer, as stored


def test_parse_expert_name():
    assert parse_expert_name("layers.3.mlp.experts.5.up_proj") == (3, 5, "up_proj")
    assert parse_expert_name("layers.3.mlp.shared_expert.up_proj") is None


def test_plan_reports_storage_and_bytes(tiny_checkpoint):
    path = tiny_checkpoint("modelopt")
    plans = {p.name: p for p in plan_weights(CheckpointReader(path), load_config(path))}
    e = plans["layers.0.mlp.experts.0.gate_proj"]
    assert (e.storage, e.is_expert, e.nbytes) == ("modelopt", True, 64 * 32 + 64 * 4 + 4)
    assert plans["layers.0.mlp.gate"].storage == "dense"
    path = tiny_checkpoint("compressed-tensors")
    plans = {p.name: p for p in plan_weights(CheckpointReader(path), load_config(path))}
    assert plans["layers.3.self_attn.o_proj"].storage == "compressed-tensors"


def test_modelopt_and_compressed_tensors_dequantize_identically(tiny_checkpoint):
    a, b = tiny_checkpoint("modelopt"), tiny_checkpoint("compressed-tensors")
    wa, wb = load_weights(a, load_config(a)), load_weights(b, load_config(b))
    for name, v in wa.items():
        if isinstance(v, NVFP4Weight):
            assert isinstance(wb[name], NVFP4Weight)
            assert v.global_scale == wb[name].global_scale, name
            assert torch.equal(dequantize_nvfp4(v), dequantize_nvfp4(wb[name])), name


def test_fp8_weights_and_ignored_activation_scales(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint("modelopt"), tmp_path / "ck")
    cfg = load_config(path)
    src = load_weights(tiny_checkpoint("bf16"), cfg, fuse=False)
    per_tensor = quantize_fp8(src["layers.0.linear_attn.out_proj"].weight)
    per_row = quantize_fp8(src["layers.0.linear_attn.in_proj_z"].weight, per_channel=True)

    def edit(t):
        p = "model.layers.0.linear_attn."
        t[p + "out_proj.weight"] = per_tensor.weight.view(torch.float8_e4m3fn)
        t[p + "out_proj.weight_scale"] = per_tensor.scale
        t[p + "out_proj.input_scale"] = torch.tensor(0.5)
        t[p + "in_proj_z.weight"] = per_row.weight.view(torch.float8_e4m3fn)
        t[p + "in_proj_z.weight_scale"] = per_row.scale
        t["model.layers.1.mlp.experts.0.up_proj.input_scale"] = torch.tensor(0.25)
        t["model.layers.3.self_attn.k_proj.k_scale"] = torch.tensor(1.0)
        t["model.layers.3.self_attn.v_scale"] = torch.tensor(1.0)
        return t

    _edit(path, edit)
    w = load_weights(path, cfg)
    got = w["layers.0.linear_attn.out_proj"]
    assert isinstance(got, FP8Weight) and got.scale.shape == ()
    assert torch.equal(got.weight, per_tensor.weight)
    assert torch.equal(dequantize_fp8(got), dequantize_fp8(per_tensor))
    # beside a dense in_proj_qkv it cannot be fused: the loader yields it on its own
    got = w["layers.0.linear_attn.in_proj_z"]
    assert isinstance(got, FP8Weight) and got.scale.shape == (64, 1)
    assert torch.equal(dequantize_fp8(got), dequantize_fp8(per_row))


def test_tied_embeddings_without_lm_head(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint("bf16"), tmp_path / "ck")
    _edit(path, lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    w = load_weights(path, load_config(path))
    assert torch.equal(w["lm_head"].weight, w["embed_tokens"])


def test_other_language_model_prefix(tmp_path, tiny_checkpoint, bf16_weights):
    path = _copy(tiny_checkpoint("bf16"), tmp_path / "ck")

    def rename(t):
        return {("language_model." + k if k.startswith("lm_head.")
                 else "language_model.model." + k.removeprefix("model.")): v
                for k, v in t.items()}

    _edit(path, rename)
    w = load_weights(path, load_config(path), fuse=False)
    assert set(w) == set(bf16_weights)
    assert torch.equal(w["lm_head"].weight, bf16_weights["lm_head"].weight)


# --------------------------------------------------------------------------------------------
# Errors: one line each, naming the file and the tensor


def _error(path: Path) -> str:
    with pytest.raises(CheckpointError) as err:
        load_weights(path, load_config(path))
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_error_missing_shard(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint("bf16-official"), tmp_path / "ck")
    (path / "model-00002-of-00003.safetensors").unlink()
    assert _error(path) == (f"{path}/model.safetensors.index.json: shard file "
                            f"'model-00002-of-00003.safetensors' is missing")


def test_error_bad_index(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint("bf16-official"), tmp_path / "ck")
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    assert _error(path) == (f"{path}/model.safetensors.index.json: not a valid safetensors "
                            f"index ('weight_map')")


def test_error_duplicate_under_two_prefixes(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint("bf16"), tmp_path / "ck")
    _edit(path, lambda t: {**t, "model.language_model.norm.weight": t["model.norm.weight"] + 0})
    msg = _error(path)
    assert msg.startswith(f"{path}/model.safetensors: tensor '")
    assert msg.endswith("' duplicates 'model.norm.weight'") or msg.endswith(
        "' duplicates 'model.language_model.norm.weight'")


def test_error_missing_tensor(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint("bf16"), tmp_path / "ck")
    _edit(path, lambda t: {k: v for k, v in t.items() if k != "model.layers.2.mlp.gate.weight"})
    assert _error(path) == f"{path}: missing tensor 'model.layers.2.mlp.gate.weight'"


def test_error_missing_quantization_tensor(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint("modelopt"), tmp_path / "ck")
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale_2"
    _edit(path, lambda t: {k: v for k, v in t.items() if k != name})
    assert _error(path) == f"{path}: missing tensor '{name}'"


def test_error_missing_compressed_tensors_scale(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint("compressed-tensors"), tmp_path / "ck")
    name = "model.layers.3.self_attn.v_proj.weight_global_scale"
    _edit(path, lambda t: {k: v for k, v in t.items() if k != name})
    assert _error(path) == f"{path}: missing tensor '{name}'"


def test_error_extra_tensor(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint("bf16"), tmp_path / "ck")
    _edit(path, lambda t: {**t, "model.layers.0.mlp.bias": torch.zeros(3)})
    assert _error(path) == f"{path}/model.safetensors: unexpected tensor 'model.layers.0.mlp.bias'"


def test_error_extra_quantization_tensor_on_dense(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint("bf16"), tmp_path / "ck")
    name = "model.layers.0.mlp.gate.weight_scale"
    _edit(path, lambda t: {**t, name: torch.ones(8, 4)})
    assert _error(path) == (f"{path}/model.safetensors: unexpected tensor '{name}' beside a "
                            f"dense weight")


def test_error_wrong_shape(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint("bf16"), tmp_path / "ck")
    name = "model.layers.3.self_attn.k_proj.weight"
    _edit(path, lambda t: {**t, name: torch.zeros(32, 64, dtype=torch.bfloat16)})
    assert _error(path) == (f"{path}/model.safetensors: tensor '{name}' has shape [32, 64], "
                            f"expected [64, 64]")


def test_error_wrong_dtype(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint("bf16"), tmp_path / "ck")
    name = "model.norm.weight"
    _edit(path, lambda t: {**t, name: torch.zeros(64, dtype=torch.int32)})
    assert _error(path) == (f"{path}/model.safetensors: tensor '{name}' has dtype I32, "
                            f"expected BF16 or F16 or F32")
    name = "model.layers.0.mlp.shared_expert.up_proj.weight"
    _edit(path, lambda t: {**t, "model.norm.weight": torch.zeros(64),
                           name: torch.zeros(32, 64, dtype=torch.int8)})
    assert _error(path) == (f"{path}/model.safetensors: tensor '{name}' has dtype I8, expected "
                            f"BF16, F16 or F32 (dense), U8 (NVFP4) or F8_E4M3 (FP8)")


def test_error_wrong_nvfp4_block_scale_shape(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint("compressed-tensors"), tmp_path / "ck")
    name = "model.layers.3.self_attn.o_proj.weight_scale"
    _edit(path, lambda t: {**t, name: t[name][:, :4].contiguous()})
    assert _error(path) == (f"{path}/model.safetensors: tensor '{name}' has shape [64, 4], "
                            f"expected [64, 8]")


def test_error_unknown_quant_method(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint("bf16"), tmp_path / "ck")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (f"{path}/config.json: quantization_config.quant_method 'awq' is "
                              f"not supported (expected modelopt or compressed-tensors)")


def test_error_truncated_file(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint("bf16"), tmp_path / "ck")
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    assert _error(path) == (f"{file}: file is truncated ({len(data) - 100} bytes, its header "
                            f"needs {len(data)})")
    file.write_bytes(data[:5])
    assert _error(path) == f"{file}: file is truncated (5 bytes, no header)"


def test_error_corrupt_header(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint("bf16"), tmp_path / "ck")
    file = path / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:12] = b"}}}}"
    file.write_bytes(bytes(data))
    assert _error(path).startswith(f"{file}: not a valid safetensors file (")


def test_error_bad_config(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint("bf16"), tmp_path / "ck")
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_experts"] = 4  # checkpoint holds 8 experts
    (path / "config.json").write_text(json.dumps(cfg))
    assert _error(path) == (f"{path}/model.safetensors: tensor 'model.layers.0.mlp.gate.weight' "
                            f"has shape [8, 64], expected [4, 64]")
    cfg["model_type"] = "qwen3_moe"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"model_type 'qwen3_moe' is not supported"):
        load_config(path)


def test_error_no_checkpoint(tmp_path):
    with pytest.raises(CheckpointError) as err:
        CheckpointReader(tmp_path)
    assert str(err.value) == f"{tmp_path}: no .safetensors files found"
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        CheckpointReader(tmp_path / "nope")


def test_resolve_model_path(tmp_path, tiny_checkpoint, monkeypatch):
    path = tiny_checkpoint("bf16")
    assert resolve_model_path(str(path)) == path
    with pytest.raises(CheckpointError) as err:
        resolve_model_path(str(tmp_path / "missing"))
    assert str(err.value) == f"{tmp_path / 'missing'}: no such checkpoint directory"
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read at import: patch the constant as well
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(CheckpointError) as err:
        resolve_model_path("nobody-here/no-such-model")
    msg = str(err.value)
    assert msg.startswith("nobody-here/no-such-model: not a local directory, and fetching it "
                          "from the Hugging Face Hub failed (")
    assert "\n" not in msg


@pytest.mark.requires_cuda
@pytest.mark.parametrize("fmt", ["modelopt", "modelopt-mixed", "bf16-official"])
def test_load_to_cuda(tiny_checkpoint, fmt):
    path = tiny_checkpoint(fmt)
    cfg = load_config(path)
    cpu = load_weights(path, cfg, dtype=torch.bfloat16)
    gpu = load_weights(path, cfg, device="cuda")  # default dtype on CUDA: bf16
    for name, v in gpu.items():
        if isinstance(v, NVFP4Weight):
            assert v.packed.is_cuda and v.block_scale.is_cuda
            assert torch.equal(v.packed.cpu(), cpu[name].packed)
        elif isinstance(v, (DenseWeight, FP8Weight)):
            assert v.weight.is_cuda
            assert torch.equal(v.weight.cpu(), cpu[name].weight)
        else:
            assert v.is_cuda and v.dtype == cpu[name].dtype
            assert torch.equal(v.cpu(), cpu[name])
    assert gpu["layers.0.linear_attn.A_log"].dtype == torch.float32
    assert gpu["embed_tokens"].dtype == torch.bfloat16


def _sparse_checkpoint(path: Path, cfg) -> Path:
    """A ModelOpt NVFP4 (experts) checkpoint at full size whose data are holes: only the
    header is real, so planning reads it exactly as it would the real thing."""
    import struct

    header, offset = {}, 0

    def add(name: str, dtype: str, shape: tuple, itemsize: int) -> None:
        nonlocal offset
        n = itemsize
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset,
                                                                                offset + n]}
        offset += n

    for name, (kind, shape) in expected_weights(cfg).items():
        raw = name if name == "lm_head" else "model.language_model." + name
        if kind == "linear" and parse_expert_name(name):
            out, inp = shape
            add(raw + ".weight", "U8", (out, inp // 2), 1)
            add(raw + ".weight_scale", "F8_E4M3", (out, inp // 16), 1)
            add(raw + ".weight_scale_2", "F32", (), 4)
        elif kind == "linear":
            add(raw + ".weight", "BF16", shape, 2)
        else:
            bare = name.endswith(("A_log", "dt_bias"))
            add(raw + ("" if bare else ".weight"), "F32" if kind == "fp32" else "BF16",
                (shape[0], 1, shape[1]) if kind == "conv" else shape,
                4 if kind == "fp32" else 2)
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5_moe", "text_config": {
            "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048,
            "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
            "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "num_experts": 256,
            "num_experts_per_tok": 8, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "eos_token_id": 248044,
            "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25}}}))
    blob = json.dumps(header).encode()
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    return path


def test_plan_at_qwen35_35b_scale(tmp_path):
    from tinyserve.model.config import ModelConfig

    cfg = ModelConfig(eos_token_ids=(248044,))
    path = _sparse_checkpoint(tmp_path / "big", cfg)
    assert load_config(path) == cfg
    plans = plan_weights(CheckpointReader(path), cfg)
    experts = [p for p in plans if p.is_expert]
    assert len(experts) == 40 * 256 * 3
    assert {p.storage for p in experts} == {"modelopt"}
    # specs/nvfp4.md §6: one W4A16 expert (gate + up + down) is 1,769,484 bytes
    assert sum(p.nbytes for p in experts) == 40 * 256 * 1_769_484
    assert CheckpointReader(path).tensor_info(
        "model.language_model.layers.39.mlp.experts.255.down_proj.weight") == (
        torch.uint8, (2048, 256))
