"""What the CPU expert kernel's int8 inputs cost in accuracy, against what NVFP4 itself costs.

The CPU kernel (kernels.moe.cpu) rounds each matrix's input to int8 per block of 16 values;
the GPU's fused MoE takes the bf16 input as it is. For experts of Qwen3.5-35B-A3B's shape
(H 2048, F 512) with weights drawn N(0, 0.02) and quantized to NVFP4, and one token's input
with a few outlier channels (as hidden states after RMSNorm carry), the relative L2 error of
one expert's output:

- format: the NVFP4 expert against the same expert in its original fp32 weights (bf16 input):
  the error every NVFP4 checkpoint already carries;
- cpu: the CPU kernel against the NVFP4 expert in fp32 math (bf16 input): what the int8
  inputs add;
- cpu_vs_original: the CPU kernel against the original weights.

    python bench/cpu_expert_error.py [--experts 64] [--out bench/results/cpu_expert_error.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import run_meta, write_json  # noqa: E402

from tinyserve.kernels.moe import cpu as nvfp4_cpu  # noqa: E402
from tinyserve.kernels.moe.fused import moe_pairs_ref, write_slot  # noqa: E402
from tinyserve.kernels.nvfp4.ref import quantize_nvfp4  # noqa: E402
from tinyserve.offload.store import HostExpertStore  # noqa: E402

H, F = 2048, 512


def _expert_output(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gu = x @ w13.T
    return (torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]) @ w2.T


def _input(g: torch.Generator, outliers: int, outlier_scale: float) -> torch.Tensor:
    x = torch.randn(1, H, generator=g)
    x[0, torch.randperm(H, generator=g)[:outliers]] *= outlier_scale
    return x.to(torch.bfloat16).float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def measure(experts: int, outliers: int, outlier_scale: float, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    store = HostExpertStore(1, experts, H, F, pin=False)
    original = []
    for r in range(experts):
        w = [torch.randn(*s, generator=g) * 0.02 for s in ((F, H), (F, H), (H, F))]
        write_slot(store.slots, r, *(quantize_nvfp4(m) for m in w))
        original.append((torch.cat(w[:2]), w[2]))
    errors: dict[str, list[float]] = {"format": [], "cpu": [], "cpu_vs_original": []}
    for r in range(experts):
        x = _input(g, outliers, outlier_scale)
        rows, one = torch.tensor([[r]]), torch.ones(1, 1)
        exact = _expert_output(x, *original[r])
        fp4 = moe_pairs_ref(x, rows, one, store.slots)
        cpu = nvfp4_cpu.moe_cpu(x, rows, one, store.slots)
        errors["format"].append(_rel(fp4, exact))
        errors["cpu"].append(_rel(cpu, fp4))
        errors["cpu_vs_original"].append(_rel(cpu, exact))
    return {name: {"median": statistics.median(v), "max": max(v)} for name, v in errors.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_expert_error.json"))
    args = p.parse_args()
    cases = {}
    for outliers, scale in ((0, 1.0), (4, 20.0), (16, 50.0)):
        name = f"outliers_{outliers}x{scale:g}"
        cases[name] = measure(args.experts, outliers, scale)
        print(name, "  ".join(f"{k} {v['median']:.4f} (max {v['max']:.4f})"
                              for k, v in cases[name].items()), flush=True)
    write_json(args.out, {**run_meta("cpu_expert_error", args=vars(args)), "cases": cases})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
