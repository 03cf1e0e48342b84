"""A full-size Qwen3.5-35B-A3B-shaped NVFP4 checkpoint with random weights, written quickly.

`write_fullsize_checkpoint(path, layers=None)` writes the real geometry (40 layers, 256
experts, vocab 248,320; ~21 GB) in the ModelOpt MIXED_PRECISION layout of
nvidia/Qwen3.6-35B-A3B-NVFP4: routed and shared experts and lm_head W4A16 NVFP4, GDN
in_proj_qkv / in_proj_z / out_proj and attention q/k/v/o FP8, everything else BF16
(A_log and linear_attn.norm F32). `layers=N` keeps the real per-layer shapes with fewer layers.
`sparse=True` writes the same headers over holes (sparse files, no data: a few MB on disk, in
seconds), for what reads headers only (the memory planner).

Random but valid: NVFP4 codes are random bytes (every nibble is a code), block scales are
E4M3 values in [0.5, 1.875], FP8 weights are rounded normals, dense tensors small normals.
Data comes from a few random pools sliced at random offsets, so writing is disk-bound. The
lm_head rows beyond the tiny tokenizer's vocabulary are zero, so greedy sampling stays inside
it; the tokenizer is `testing.tokenizer`'s.

    python -m tinyserve.testing.fullsize /tmp/qwen35-fullsize [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from typing import Any

import torch

from tinyserve.model.config import ModelConfig
from tinyserve.testing.tokenizer import TINY_VOCAB_SIZE, save_tiny_tokenizer

_POOL = 1 << 26  # elements per random pool


class _Pools:
    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.codes = torch.randint(0, 256, (_POOL,), dtype=torch.uint8, generator=g)
        self.scales = torch.randint(0x30, 0x40, (_POOL,), dtype=torch.uint8, generator=g)
        normal = torch.randn(_POOL, generator=g)
        self.dense = (normal * 0.02).to(torch.bfloat16)
        self.fp8 = (normal * 64).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)

    def take(self, pool: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        n = math.prod(shape)
        if n > pool.numel():
            reps = -(-n // pool.numel())
            return pool.repeat(reps)[:n].view(shape)
        off = self.rng.randrange(pool.numel() - n + 1)
        return pool[off:off + n].view(shape)


_ST_DTYPES = {torch.uint8: "U8", torch.bfloat16: "BF16", torch.float32: "F32",
              torch.float8_e4m3fn: "F8_E4M3"}


class _MetaPools(_Pools):
    """Tensors of the right shapes and dtypes and no data (`sparse=True`)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        meta = torch.device("meta")
        self.codes = self.scales = self.fp8 = torch.empty(_POOL, dtype=torch.uint8, device=meta)
        self.dense = torch.empty(_POOL, dtype=torch.bfloat16, device=meta)

    def take(self, pool: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=pool.dtype, device="meta")


class _StreamWriter:
    """Safetensors shards written tensor by tensor straight from memory (no copies); with
    `sparse`, the data regions are left as holes."""

    def __init__(self, path: Path, max_shard_bytes: int, sparse: bool = False) -> None:
        self.sparse = sparse
        path.mkdir(parents=True, exist_ok=True)
        if any(path.glob("*.safetensors")):
            raise ValueError(f"{path}: already holds a checkpoint")
        self.path, self.max = path, max_shard_bytes
        self.shards: list[list[tuple[str, torch.Tensor]]] = [[]]
        self.size = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.shards[-1] and self.size + n > self.max:
            self.shards.append([])
            self.size = 0
        self.shards[-1].append((name, t.contiguous()))
        self.size += n

    def close(self) -> None:
        names = [f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors"
                 for i in range(len(self.shards))]
        weight_map = {}
        for file, tensors in zip(names, self.shards, strict=True):
            header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
            off = 0
            for name, t in tensors:
                n = t.numel() * t.element_size()
                header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                                "data_offsets": [off, off + n]}
                off += n
                weight_map[name] = file
            blob = json.dumps(header, separators=(",", ":")).encode()
            blob += b" " * (-len(blob) % 8)
            with open(self.path / file, "wb") as f:
                f.write(len(blob).to_bytes(8, "little"))
                f.write(blob)
                if self.sparse:
                    f.truncate(8 + len(blob) + off)
                    continue
                for _, t in tensors:
                    f.write(t.reshape(-1).view(torch.uint8).numpy().data)
        index = {"metadata": {}, "weight_map": weight_map}
        (self.path / "model.safetensors.index.json").write_text(json.dumps(index) + "\n")


def _text_config(c: ModelConfig, eos: list[int]) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers, "layer_types": list(c.layer_types),
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "linear_num_key_heads": c.linear_num_key_heads,
        "linear_num_value_heads": c.linear_num_value_heads,
        "linear_key_head_dim": c.linear_key_head_dim,
        "linear_value_head_dim": c.linear_value_head_dim,
        "linear_conv_kernel_dim": c.linear_conv_kernel_dim, "num_experts": c.num_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "moe_intermediate_size": c.moe_intermediate_size,
        "shared_expert_intermediate_size": c.shared_expert_intermediate_size,
        "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": eos,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                            "partial_rotary_factor": c.partial_rotary_factor,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    }


def _fmt(name: str) -> str:
    if ".mlp.experts." in name or ".mlp.shared_expert." in name or name == "lm_head":
        return "nvfp4"
    if name.endswith(("in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "k_proj", "v_proj",
                      "o_proj")):
        return "fp8"
    return "bf16"


def write_fullsize_checkpoint(path: str | Path, *, layers: int | None = None, seed: int = 0,
                              max_shard_bytes: int = 4 << 30,
                              vocab_size: int | None = None, sparse: bool = False) -> Path:
    """Write the checkpoint into `path` (created; must not hold one). Returns `path`.

    `vocab_size` shrinks the vocabulary (tests); everything else keeps the real shapes.
    `sparse`: headers only, over holes (see the module docstring).
    """
    from tinyserve.model.loader_plan import expected_weights

    path = Path(path)
    base = ModelConfig()
    n = layers or base.num_layers
    c = ModelConfig(num_layers=n, layer_types=base.layer_types[:n] if n <= base.num_layers
                    else tuple(base.layer_types[i % 4] for i in range(n)),
                    vocab_size=vocab_size or base.vocab_size, eos_token_ids=())
    pools = _MetaPools(seed) if sparse else _Pools(seed)
    writer = _StreamWriter(path, max_shard_bytes, sparse)
    done: dict[str, str] = {}
    for name, (kind, shape) in expected_weights(c).items():
        raw = "lm_head" if name == "lm_head" else f"model.{name}"
        if kind == "fp32" or name.endswith("dt_bias"):
            bare = name.endswith(("A_log", "dt_bias"))
            if name.endswith("A_log"):
                t = torch.log(torch.linspace(1.0, 16.0, shape[0]))
            elif name.endswith("dt_bias"):
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                t = 1.0 + 0.1 * torch.randn(shape)
            writer.add(raw if bare else raw + ".weight", t)
            continue
        if kind != "linear":
            if kind == "conv":
                shape = (shape[0], 1, shape[1])
            t = pools.take(pools.dense, shape)
            if (name.endswith("norm") or "layernorm" in name) and not t.is_meta:
                t = t * 5  # zero-centred RMSNorm weights: 1 + w
            writer.add(raw + ".weight", t)
            continue
        fmt, (out, inp) = _fmt(name), shape
        done[name] = fmt
        if fmt == "bf16":
            writer.add(raw + ".weight", pools.take(pools.dense, shape))
        elif fmt == "fp8":
            writer.add(raw + ".weight", pools.take(pools.fp8, shape).view(torch.float8_e4m3fn))
            writer.add(raw + ".weight_scale", torch.tensor(0.02 / 64 / math.sqrt(inp / 2048)))
        else:
            codes = pools.take(pools.codes, (out, inp // 2))
            if name == "lm_head":
                codes = codes.clone()
                codes[TINY_VOCAB_SIZE:] = 0
            writer.add(raw + ".weight", codes)
            writer.add(raw + ".weight_scale",
                       pools.take(pools.scales, (out, inp // 16)).view(torch.float8_e4m3fn))
            writer.add(raw + ".weight_scale_2", torch.tensor(0.012 / math.sqrt(inp / 512)))
    writer.close()
    special = save_tiny_tokenizer(path)
    eos = [special["<|im_end|>"], special["<|endoftext|>"]]
    cfg = _text_config(c, eos)
    _write_quant_config(path, cfg, done)
    return path


def _write_quant_config(path: Path, cfg: dict[str, Any], done: dict[str, str]) -> None:
    producer = {"name": "modelopt", "version": "tinyserve-fullsize"}
    layers: dict[str, Any] = {}
    for name, fmt in done.items():
        if fmt == "bf16":
            continue
        module = "lm_head" if name == "lm_head" else "model." + name
        if ".mlp.experts." in module:
            module = module.split(".mlp.experts.")[0] + ".mlp.experts"
        layers[module] = ({"quant_algo": "FP8"} if fmt == "fp8"
                          else {"quant_algo": "W4A16_NVFP4", "group_size": 16})
    quant = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
             "quantized_layers": layers, "exclude_modules": []}
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                                  "producer": producer, "quantized_layers": layers,
                                  "ignore": [], "kv_cache_scheme": None}
    (path / "hf_quant_config.json").write_text(
        json.dumps({"producer": producer, "quantization": quant}, indent=1) + "\n")
    (path / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", help="output directory (must not hold a checkpoint)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers, real shapes")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = write_fullsize_checkpoint(args.path, layers=args.layers, seed=args.seed)
    total = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out} ({total / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
