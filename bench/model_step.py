"""One model step of Qwen3.5-35B-A3B geometry on one CUDA GPU: the full torch model with its
kernels (Triton GDN, NVFP4 GEMM, fused MoE) against the same model on the pure-torch
references (TINYSERVE_DISABLE_KERNELS=1), measured in the same run.

Random weights with the real per-layer shapes (hidden 2048, 256 NVFP4 experts top-8, GDN 16/32
heads, attention 16/2 x 256), `--layers` layers (default 4 = 3 GDN + 1 attention) and the real
vocabulary. Cases: decode of 1 and 8 sequences at a 1k-token context, and a 2k-token prefill.
Reported per step and per layer (the 40-layer model is ~10x the per-4-layer step, plus the
head). Each case records its own failure; the rest go on.

    python bench/model_step.py [--layers 4]      -> bench/results/model_step.json
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from common import Recorder, median_ms, run_meta  # bench/ is on sys.path as a script

from tinyserve.core import DenseWeight, NVFP4Weight, ScheduledSeq
from tinyserve.engine.runner import ModelRunner
from tinyserve.kv.bf16 import BF16KVBackend
from tinyserve.kv.state_pool import GDNStatePool
from tinyserve.model.config import ModelConfig
from tinyserve.model.qwen35 import Qwen35Model

OUT = Path(__file__).resolve().parent / "results" / "model_step.json"
PAGE = 16
CONTEXT = 1024


def _config(layers: int) -> ModelConfig:
    types = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                  for i in range(layers))
    return ModelConfig(num_layers=layers, layer_types=types)


def _weights(cfg: ModelConfig, dev: str) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)

    def dense(o: int, i: int) -> DenseWeight:
        return DenseWeight((torch.randn(o, i, generator=g, device=dev) * 0.02).bfloat16())

    def fp4(o: int, i: int) -> NVFP4Weight:
        packed = torch.randint(0, 256, (o, i // 2), generator=g, device=dev, dtype=torch.uint8)
        # E4M3 bits 0x30..0x3F: block scales 0.5 .. 1.875
        scale = torch.randint(0x30, 0x40, (o, i // 16), generator=g, device=dev,
                              dtype=torch.uint8)
        return NVFP4Weight(packed, scale, 0.004)

    def vec(n: int, base: float = 0.0) -> torch.Tensor:
        return base + 0.1 * torch.randn(n, generator=g, device=dev)

    H, F = cfg.hidden_size, cfg.moe_intermediate_size
    w: dict = {"embed_tokens": torch.randn(cfg.vocab_size, H, generator=g, device=dev)
               .bfloat16() * 0.02, "lm_head": dense(cfg.vocab_size, H), "norm": vec(H)}
    for L, kind in enumerate(cfg.layer_types):
        p = f"layers.{L}."
        w[p + "input_layernorm"], w[p + "post_attention_layernorm"] = vec(H), vec(H)
        if kind == "linear_attention":
            a = p + "linear_attn."
            hv = cfg.linear_num_value_heads
            w[a + "in_proj_qkv"] = dense(cfg.linear_conv_dim, H)
            w[a + "in_proj_z"] = dense(cfg.linear_value_dim, H)
            w[a + "in_proj_b"], w[a + "in_proj_a"] = dense(hv, H), dense(hv, H)
            w[a + "out_proj"] = dense(H, cfg.linear_value_dim)
            w[a + "conv1d"] = torch.randn(cfg.linear_conv_dim, cfg.linear_conv_kernel_dim,
                                          generator=g, device=dev) * 0.3
            w[a + "A_log"] = torch.rand(hv, generator=g, device=dev).mul(2.7).log1p()
            w[a + "dt_bias"], w[a + "norm"] = vec(hv), vec(cfg.linear_value_head_dim, 1.0)
        else:
            a = p + "self_attn."
            D = cfg.head_dim
            w[a + "q_proj"] = dense(2 * cfg.num_attention_heads * D, H)
            w[a + "k_proj"], w[a + "v_proj"] = dense(cfg.num_kv_heads * D, H), dense(
                cfg.num_kv_heads * D, H)
            w[a + "o_proj"] = dense(H, cfg.num_attention_heads * D)
            w[a + "q_norm"], w[a + "k_norm"] = vec(D), vec(D)
        m = p + "mlp."
        w[m + "gate"] = dense(cfg.num_experts, H)
        S = cfg.shared_expert_intermediate_size
        w[m + "shared_expert.gate_proj"], w[m + "shared_expert.up_proj"] = fp4(S, H), fp4(S, H)
        w[m + "shared_expert.down_proj"] = fp4(H, S)
        w[m + "shared_expert_gate"] = dense(1, H)
        for e in range(cfg.num_experts):
            w[f"{m}experts.{e}.gate_proj"], w[f"{m}experts.{e}.up_proj"] = fp4(F, H), fp4(F, H)
            w[f"{m}experts.{e}.down_proj"] = fp4(H, F)
    return w


def _runner(cfg: ModelConfig, w: dict, num_seqs: int) -> ModelRunner:
    pages = num_seqs * (CONTEXT // PAGE + 2) + 140
    kv = BF16KVBackend(layer_ids=list(cfg.full_attention_layers), num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, num_pages=pages, page_size=PAGE, device="cuda",
                       dtype=torch.bfloat16)
    states = GDNStatePool.for_config(cfg, num_seqs, device="cuda", dtype=torch.bfloat16)
    for t in (kv.k_cache, kv.v_cache, states.conv):
        t.normal_(0, 0.5)
    states.recurrent.normal_(0, 0.05)
    model = Qwen35Model(cfg, w, kv=kv, states=states, device="cuda", dtype=torch.bfloat16)
    return ModelRunner(model, page_size=PAGE)





def _step(cfg: ModelConfig, w: dict, kind: str, n: int, reps: int) -> dict:
    """Milliseconds of one step: decode of n sequences at CONTEXT, or an n-token prefill."""
    per = CONTEXT // PAGE + 2
    if kind == "decode":
        runner = _runner(cfg, w, n)
        seqs = [ScheduledSeq(f"s{i}", [7 + i], CONTEXT, list(range(i * per, (i + 1) * per)), i,
                             sample=True) for i in range(n)]
    else:
        runner = _runner(cfg, w, 1)
        seqs = [ScheduledSeq("p", list(range(1, n + 1)), 0, list(range(n // PAGE + 1)), 0,
                             sample=True)]
    ctx = runner.prepare(seqs)
    ms = median_ms(lambda: runner.run(ctx), reps)
    return {"ms_per_step": ms, "ms_per_layer": ms / cfg.num_layers}


def model_meta(cfg: ModelConfig, **extra: object) -> dict:
    """The JSON description of the `_config` / `_weights` model (with `extra` keys)."""
    return {"layers": cfg.num_layers, "layer_types": list(cfg.layer_types),
            "geometry": "Qwen3.5-35B-A3B", "experts": "NVFP4 (random codes)",
            "other_linears": "bf16 (shared expert NVFP4)", "page_size": PAGE, **extra}


def _kernels_vs_reference(cfg, w, kind: str, n: int, reps: int, ref_reps: int) -> dict:
    os.environ.pop("TINYSERVE_DISABLE_KERNELS", None)
    fast = _step(cfg, w, kind, n, reps)
    torch.cuda.empty_cache()
    os.environ["TINYSERVE_DISABLE_KERNELS"] = "1"
    try:
        ref = _step(cfg, w, kind, n, ref_reps)
    finally:
        os.environ.pop("TINYSERVE_DISABLE_KERNELS", None)
    return {"kernels": fast, "reference": ref,
            "speedup": ref["ms_per_step"] / fast["ms_per_step"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    cfg = _config(args.layers)
    rec = Recorder(args.out, run_meta(
        "model_step", bench="model_step",
        model=model_meta(cfg, kv="bf16", context=CONTEXT),
        baseline="same model on the pure-torch references (TINYSERVE_DISABLE_KERNELS=1), "
                 "same GPU, same run"))
    w = _weights(cfg, "cuda")
    cases = [("decode_b1", "decode", 1, 20, 3), ("decode_b8", "decode", 8, 20, 3),
             ("prefill_2k", "prefill", 2048, 5, 2)]
    for name, kind, n, reps, ref_reps in cases:
        rec.run(name, _kernels_vs_reference, cfg, w, kind, n, reps, ref_reps)
        torch.cuda.empty_cache()
    print(f"wrote {args.out}")
    return 0 if not rec.data["errors"] else 2


if __name__ == "__main__":
    sys.exit(main())
