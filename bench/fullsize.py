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
it; the tokenizer is `testing.tokenizer`'s. The random router spreads the tokens evenly over
the experts (the worst case for the expert cache); `routing="realistic"` writes a router,
embedding and lm_head that route with a real model's skew and locality instead
(`bench.routing`, docs/ROUTING.md).

    python -m bench.fullsize /tmp/qwen35-fullsize [--layers 4] [--routing realistic]
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from typing import Any

import torch

from bench.routing import ROUTING_FILE, ROUTINGS, RealisticRouting
from tinyserve.model.config import ModelConfig
from tinyserve.testing.tokenizer import (
    TINY_VOCAB_SIZE,
    save_tiny_tokenizer,
    special_token_ids,
)

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
    """Safetensors shards written tensor by tensor straight from memory (no copies); a shard
    is written as soon as it is full (under a temporary name until `close`), so only one
    shard's tensors are held at a time. With `sparse`, the data regions are left as holes."""

    def __init__(self, path: Path, max_shard_bytes: int, sparse: bool = False) -> None:
        self.sparse = sparse
        path.mkdir(parents=True, exist_ok=True)
        if any(path.glob("*.safetensors")):
            raise ValueError(f"{path}: already holds a checkpoint")
        self.path, self.max = path, max_shard_bytes
        self.shard: list[tuple[str, torch.Tensor]] = []
        self.size = 0
        self.written: list[tuple[Path, list[str]]] = []  # temporary file, its tensor names

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.shard and self.size + n > self.max:
            self._flush()
        self.shard.append((name, t.contiguous()))
        self.size += n

    def _flush(self) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        off = 0
        for name, t in self.shard:
            n = t.numel() * t.element_size()
            header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                            "data_offsets": [off, off + n]}
            off += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        tmp = self.path / f"shard-{len(self.written):05d}.tmp"
        with open(tmp, "wb") as f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            if self.sparse:
                f.truncate(8 + len(blob) + off)
            else:
                for _, t in self.shard:
                    f.write(t.reshape(-1).view(torch.uint8).numpy().data)
        self.written.append((tmp, [name for name, _ in self.shard]))
        self.shard, self.size = [], 0

    def close(self) -> None:
        if self.shard:
            self._flush()
        weight_map = {}
        for i, (tmp, names) in enumerate(self.written):
            file = f"model-{i + 1:05d}-of-{len(self.written):05d}.safetensors"
            tmp.rename(self.path / file)
            weight_map.update(dict.fromkeys(names, file))
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
                              vocab_size: int | None = None,
                              routing: str = "uniform", sparse: bool = False) -> Path:
    """Write the checkpoint into `path` (created; must not hold one). Returns `path`.

    `vocab_size` shrinks the vocabulary (tests); everything else keeps the real shapes.
    `routing`: "uniform" (the random router: tokens spread evenly over the experts) or
    "realistic" (skewed, temporally local routing and a fixed greedy text, see
    `bench.routing`; its manifest is written to `routing.ROUTING_FILE`).
    `sparse`: headers only, over holes (see the module docstring; uniform routing only).
    Raises ValueError for an unknown routing.
    """
    from tinyserve.model.loader_plan import expected_weights

    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r} (expected one of {ROUTINGS})")
    if sparse and routing != "uniform":
        raise ValueError("a sparse checkpoint has no data to route by: uniform routing only")
    path = Path(path)
    base = ModelConfig()
    n = layers or base.num_layers
    c = ModelConfig(num_layers=n, layer_types=base.layer_types[:n] if n <= base.num_layers
                    else tuple(base.layer_types[i % 4] for i in range(n)),
                    vocab_size=vocab_size or base.vocab_size, eos_token_ids=())
    design = None
    if routing == "realistic":
        design = RealisticRouting(hidden=c.hidden_size, num_experts=c.num_experts,
                                  top_k=c.num_experts_per_tok, vocab_size=c.vocab_size,
                                  text_tokens=range(min(special_token_ids().values())),
                                  seed=seed)
    pools = _MetaPools(seed) if sparse else _Pools(seed)
    norm_gen = torch.Generator().manual_seed(seed)
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
                t = 1.0 + 0.1 * torch.randn(shape, generator=norm_gen)
            writer.add(raw if bare else raw + ".weight", t)
            continue
        if kind != "linear":
            if kind == "conv":
                shape = (shape[0], 1, shape[1])
            t = pools.take(pools.dense, shape)
            if (name.endswith("norm") or "layernorm" in name) and not t.is_meta:
                t = t * 5  # zero-centred RMSNorm weights: 1 + w
            if design is not None:
                t = _route_tensor(design, name, t)
            writer.add(raw + ".weight", t)
            continue
        fmt, (out, inp) = _fmt(name), shape
        done[name] = fmt
        if fmt == "bf16":
            t = pools.take(pools.dense, shape)
            if design is not None and name.endswith(".mlp.gate"):
                t = design.router(int(name.split(".")[1])).to(torch.bfloat16)
            writer.add(raw + ".weight", t)
        elif fmt == "fp8":
            t = pools.take(pools.fp8, shape)
            if design is not None and name.endswith(("o_proj", "out_proj")):
                t = _zero_rows(t, design.reserved)
            writer.add(raw + ".weight", t.view(torch.float8_e4m3fn))
            writer.add(raw + ".weight_scale", torch.tensor(0.02 / 64 / math.sqrt(inp / 2048)))
        else:
            codes = pools.take(pools.codes, (out, inp // 2))
            scales = pools.take(pools.scales, (out, inp // 16))
            global_scale = torch.tensor(0.012 / math.sqrt(inp / 512))
            if name == "lm_head" and design is not None:
                codes, scales, global_scale = _routed_lm_head(design, out, inp)
            elif name == "lm_head":
                codes = codes.clone()
                codes[TINY_VOCAB_SIZE:] = 0
            elif design is not None and name.endswith("down_proj"):
                codes = _zero_rows(codes, design.reserved)
            writer.add(raw + ".weight", codes)
            writer.add(raw + ".weight_scale", scales.view(torch.float8_e4m3fn))
            writer.add(raw + ".weight_scale_2", global_scale)
    writer.close()
    special = save_tiny_tokenizer(path)
    eos = [special["<|im_end|>"], special["<|endoftext|>"]]
    cfg = _text_config(c, eos)
    _write_quant_config(path, cfg, done)
    if design is not None:
        (path / ROUTING_FILE).write_text(json.dumps(design.manifest()) + "\n")
    return path


def _zero_rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    t = t.clone()
    t[rows] = 0  # (0 is +0.0 in FP8 and NVFP4 alike)
    return t


def _route_tensor(design: RealisticRouting, name: str, t: torch.Tensor) -> torch.Tensor:
    """The embedding and the norms in front of the router and the lm_head, routed."""
    if name == "embed_tokens":
        return design.embedding(t)
    if name == "norm" or name.endswith("post_attention_layernorm"):
        return _zero_rows(t, design.reserved)  # a factor 1 + 0 on the routing channels
    return t


def _routed_lm_head(design: RealisticRouting, out: int, inp: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 (codes, block scales, global scale) of the lm_head that walks the token cycle."""
    from tinyserve.kernels.nvfp4.ref import quantize_nvfp4

    q = quantize_nvfp4(design.lm_head(TINY_VOCAB_SIZE))
    codes = torch.zeros(out, inp // 2, dtype=torch.uint8)
    scales = torch.full((out, inp // 16), 0x38, dtype=torch.uint8)  # 1.0 (zero rows)
    codes[:TINY_VOCAB_SIZE] = q.packed
    scales[:TINY_VOCAB_SIZE] = q.block_scale.view(torch.uint8)
    return codes, scales, torch.tensor(q.global_scale, dtype=torch.float32)


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
    p.add_argument("--routing", choices=ROUTINGS, default="uniform",
                   help="uniform: the random router; realistic: skewed, local routing")
    args = p.parse_args(argv)
    out = write_fullsize_checkpoint(args.path, layers=args.layers, seed=args.seed,
                                    routing=args.routing)
    total = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out} ({total / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
