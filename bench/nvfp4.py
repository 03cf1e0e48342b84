"""NVFP4 W4A16 kernels vs bf16 cuBLAS on Qwen3.5-35B-A3B shapes -> bench/results/nvfp4.json.

Measured in one run on one CUDA device:
1. device copy bandwidth (1 GiB device-to-device copy, bytes read + written);
2. M = 1, 2, 4, 8, 16: each NVFP4 path and the default vs torch.matmul on a bf16 weight;
   achieved weight bandwidth as a fraction of the copy bandwidth (target >= 0.6 at >= 8 MB of
   weights); a sweep of gemv tile configs per shape at M = 1 (`gemv_sweep_M1`, best marked)
   and on the two big shapes at M = 4 (`gemv_sweep_M4`);
3. M = 512, 2048: TFLOP/s of the `dot` and `dequant` paths vs bf16 cuBLAS;
4. fused MoE: one token x 8 of 256 NVFP4 experts (gemv path) vs the time to read its 8
   experts' bytes at copy bandwidth (target <= 2x), for a few tile configs; 2048 tokens x 8
   over 256 experts, both
   paths, vs a per-expert bf16 cuBLAS loop.
Every case is timed inside a CUDA graph (launch overhead amortised) and cycles through enough
weight copies to exceed L2, so the numbers are HBM numbers. A failing case is recorded with
its error and the run goes on. Usage: python bench/nvfp4.py [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tinyserve.core import NVFP4Weight  # noqa: E402
from tinyserve.kernels.fused_moe import (  # noqa: E402
    DEFAULT_MOE_GEMV,
    MoEGemvConfig,
    allocate_expert_slots,
    fused_moe,
)
from tinyserve.kernels.nvfp4 import (  # noqa: E402
    PATHS,
    GemvConfig,
    choose_path,
    default_gemv_config,
    nvfp4_linear,
)

SHAPES = {  # name: (N, K)
    "gate_up_2048_1024": (1024, 2048), "down_512_2048": (2048, 512),
    "qkvz_2048_8192": (8192, 2048), "o_4096_2048": (2048, 4096),
    "lm_head_2048_248320": (248320, 2048),
}
GEMV_SWEEP = [  # (block_n, block_b, num_warps, programs_per_sm, prefetch); + the default
    GemvConfig(8, 128, 4, 0), GemvConfig(16, 128, 4, 0), GemvConfig(4, 128, 4, 0),
    GemvConfig(16, 128, 8, 0), GemvConfig(32, 32, 4, 0), GemvConfig(64, 32, 8, 0),
    GemvConfig(8, 128, 4, 1), GemvConfig(8, 128, 4, 0, True)]
MOE_SWEEP = [DEFAULT_MOE_GEMV, MoEGemvConfig(8, 128, 8, 32, 4, False, 2),
             MoEGemvConfig(4, 128, 16, 32, 4, False, 4), MoEGemvConfig(4, 128, 4, 32, 4, False, 2),
             MoEGemvConfig(2, 128, 8, 32, 2, False, 2), MoEGemvConfig(8, 128, 16, 32, 4, False, 2),
             MoEGemvConfig(4, 128, 8, 32, 4, False, 4)]
ROTATE_BYTES = 256 << 20  # cycle weight copies until this many bytes (> L2)
RESULTS: dict = {}
OUT_PATH = ROOT / "bench/results/nvfp4.json"


def time_graph(fns: list, reps: int = 10, stat=statistics.median) -> float:
    """Median (or `stat`) microseconds per call of the calls in `fns`, replayed in one CUDA
    graph."""
    for fn in fns[:2]:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return stat(times)


def record(section: str, key: str, fn) -> None:
    try:
        RESULTS.setdefault(section, {})[key] = fn()
    except Exception as exc:  # noqa: BLE001 - one failed case must not stop the run
        RESULTS.setdefault(section, {})[key] = {"error": f"{type(exc).__name__}: {exc}"}
        traceback.print_exc()
    print(section, key, json.dumps(RESULTS[section][key]), flush=True)
    # NOTE: rewritten after every case so a run cut short by a timeout still leaves its numbers
    OUT_PATH.parent.mkdir(parents=True, exist_ok=True)
    OUT_PATH.write_text(json.dumps(RESULTS, indent=2) + "\n")


def copy_bandwidth() -> dict:
    """Steady state: 20 copies of 1 GiB per graph replay, after a warm-up; the best replay
    (the first version timed 4 copies and read 2.8 TB/s where a 20-copy loop gave 4.2)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(20):
        b.copy_(a)
    med = time_graph([lambda: b.copy_(a)] * 20, reps=5)
    best = time_graph([lambda: b.copy_(a)] * 20, reps=5, stat=min)
    # read-only reference: a bf16 GEMV (cuBLAS) over a 1 GiB weight streams it once
    w = a.view(torch.bfloat16).view(1 << 15, 1 << 14)
    v = torch.randn(1 << 14, 1, device="cuda", dtype=torch.bfloat16)
    read = time_graph([lambda: w @ v] * 20, reps=5, stat=min)
    out = {"bytes": 2 * n, "us": best, "copy_GBps": 2 * n / best / 1e3,
           "copy_median_GBps": 2 * n / med / 1e3, "gemv_read_GBps": n / read / 1e3}
    out["GBps"] = max(out["copy_GBps"], out["gemv_read_GBps"])  # the reference below
    return out


def rand_nvfp4(n: int, k: int) -> NVFP4Weight:
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    scale = torch.randint(0x30, 0x48, (n, k // 16), dtype=torch.uint8, device="cuda")
    return NVFP4Weight(packed, scale, 0.5 / k**0.5)


def nvfp4_bytes(n: int, k: int) -> int:
    return n * k // 2 + n * k // 16


def copies(nbytes: int) -> int:
    return max(1, min(32, -(-ROTATE_BYTES // nbytes)))


def bench_linear(name: str, m: int, bw: float) -> dict:
    n, k = SHAPES[name]
    wb = nvfp4_bytes(n, k)
    ws = [rand_nvfp4(n, k) for _ in range(copies(wb))]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out: dict = {"N": n, "K": k, "M": m, "weight_bytes": wb, "default": choose_path(m, n, k)}
    for path in PATHS:
        if path == "gemv" and m > 16:
            continue
        try:
            us = time_graph([lambda w=w, p=path: nvfp4_linear(x, w, path=p) for w in ws])
            out[path] = {"us": us, "frac_copy_bw": wb / us / 1e3 / bw,
                         "TFLOPs": 2 * m * n * k / us / 1e6}
        except Exception as exc:  # noqa: BLE001
            out[path] = {"error": f"{type(exc).__name__}: {exc}"}
    del ws
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
             for _ in range(copies(2 * n * k))]
    us = time_graph([lambda d=d: x @ d.T for d in dense])
    out["bf16_cublas"] = {"us": us, "frac_copy_bw": 2 * n * k / us / 1e3 / bw,
                          "TFLOPs": 2 * m * n * k / us / 1e6}
    best = min(out[p]["us"] for p in PATHS if "us" in out.get(p, {}))
    out["best_nvfp4_vs_bf16_speedup"] = us / best
    return out


def bench_gemv_sweep(name: str, m: int, bw: float) -> dict:
    """gemv path, the shape's default tiles and the GEMV_SWEEP candidates; the best marked."""
    n, k = SHAPES[name]
    wb = nvfp4_bytes(n, k)
    ws = [rand_nvfp4(n, k) for _ in range(copies(wb))]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    default = default_gemv_config(n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    out: dict = {"default": gemv_key(default)}
    for cfg in [default] + [c for c in GEMV_SWEEP if c != default]:
        key = gemv_key(cfg)
        try:
            us = time_graph([lambda w=w, c=cfg: nvfp4_linear(x, w, path="gemv", gemv_config=c)
                             for w in ws])
            out[key] = {"us": us, "frac_copy_bw": wb / us / 1e3 / bw}
        except Exception as exc:  # noqa: BLE001
            out[key] = {"error": f"{type(exc).__name__}: {exc}"}
    timed = {kk: v["us"] for kk, v in out.items() if isinstance(v, dict) and "us" in v}
    if timed:
        best = min(timed, key=timed.get)
        out["best"] = {"config": best, "us": timed[best],
                       "frac_copy_bw": wb / timed[best] / 1e3 / bw}
    return out


def gemv_key(cfg: GemvConfig) -> str:
    pf = "_pf" if cfg.prefetch else ""
    return f"bn{cfg.block_n}_bb{cfg.block_b}_w{cfg.num_warps}_pps{cfg.programs_per_sm}{pf}"


def expert_slots_fp4(num: int, h: int, f: int):
    slots = allocate_expert_slots(num, h, f, fp4=True, device="cuda")
    slots.w13.random_(0, 256)
    slots.w2.random_(0, 256)
    slots.w13_scale.random_(0x30, 0x48)
    slots.w2_scale.random_(0x30, 0x48)
    slots.w13_global.fill_(0.5 / h**0.5)
    slots.w2_global.fill_(0.5 / f**0.5)
    return slots


def bench_moe_decode(bw: float, h: int = 2048, f: int = 512, e: int = 256) -> dict:
    k = 8
    slots = expert_slots_fp4(e, h, f)
    x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)
    w = torch.softmax(torch.randn(1, k, device="cuda"), -1)
    # 20 different routings per graph: 160 expert reads, ~280 MB, more than L2
    routes = [torch.randperm(e, device="cuda")[:k].reshape(1, k) for _ in range(20)]
    expert_bytes = 3 * nvfp4_bytes(f, h)
    read_us = k * expert_bytes / bw / 1e3
    out: dict = {"bytes_8_experts": k * expert_bytes, "read_at_copy_bw_us": read_us}
    for cfg in MOE_SWEEP:  # the default first
        key = "default" if cfg == DEFAULT_MOE_GEMV else (
            f"gu{cfg.gate_up_block_n}x{cfg.gate_up_block_b}_dn{cfg.down_block_n}x"
            f"{cfg.down_block_b}_w{cfg.num_warps}_dw{cfg.down_num_warps}"
            f"{'_pf' if cfg.prefetch else ''}")
        try:
            us = time_graph([lambda r=r, c=cfg: fused_moe(x, r, w, slots, path="gemv",
                                                          gemv_config=c) for r in routes])
            out[key] = {"us": us, "ratio_to_read_time": us / read_us,
                        "frac_copy_bw": read_us / us}
        except Exception as exc:  # noqa: BLE001
            out[key] = {"error": f"{type(exc).__name__}: {exc}"}
    timed = {kk: v["us"] for kk, v in out.items() if isinstance(v, dict) and "us" in v}
    if timed:
        best = min(timed, key=timed.get)
        out["best"] = {"config": best, "us": timed[best],
                       "ratio_to_read_time": timed[best] / read_us}
    return out


def bench_moe_prefill(tokens: int, h: int = 2048, f: int = 512, e: int = 256) -> dict:
    k = 8
    slots = expert_slots_fp4(e, h, f)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, k, device="cuda"), -1)
    flops = 2 * tokens * k * 3 * h * f
    out: dict = {"tokens": tokens, "experts": e, "topk": k}
    for path in ("dot", "gemv"):
        try:
            us = time_graph([lambda p=path, s=slots: fused_moe(x, ids, w, s, path=p)],
                            reps=3)
            out[path] = {"us": us, "TFLOPs": flops / us / 1e6}
        except Exception as exc:  # noqa: BLE001
            out[path] = {"error": f"{type(exc).__name__}: {exc}"}
    # baseline: per-expert bf16 cuBLAS loop (gather, gate_up, silu*up, down, scatter-add)
    del slots
    w13 = torch.randn(e, 2 * f, h, device="cuda", dtype=torch.bfloat16) / h**0.5
    w2 = torch.randn(e, h, f, device="cuda", dtype=torch.bfloat16) / f**0.5
    flat = ids.flatten()
    groups = [(flat == s).nonzero().flatten() for s in range(e)]

    def loop() -> torch.Tensor:
        y = torch.zeros(tokens * k, h, device="cuda", dtype=torch.bfloat16)
        for s, rows in enumerate(groups):
            gu = x[rows // k] @ w13[s].T
            y[rows] = (torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]) @ w2[s].T
        return y

    us = time_graph([loop], reps=3)
    out["bf16_cublas_loop"] = {"us": us, "TFLOPs": flops / us / 1e6}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="M=1 only, no lm_head, no prefill")
    ap.add_argument("--out", default=str(ROOT / "bench/results/nvfp4.json"))
    args = ap.parse_args()
    global OUT_PATH
    OUT_PATH = Path(args.out)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    import triton

    RESULTS["meta"] = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "timing": "median of 10 CUDA-graph replays, weights rotated past L2",
    }
    record("copy_bandwidth", "d2d_1GiB", copy_bandwidth)
    bw = RESULTS["copy_bandwidth"]["d2d_1GiB"].get("GBps", 4000.0)
    shapes = [s for s in SHAPES if not (args.quick and s.startswith("lm_head"))]
    # NOTE: most important first, so a run cut short by a timeout keeps those
    for name in shapes:
        record("gemv", f"{name}_M1", lambda n=name: bench_linear(n, 1, bw))
    record("fused_moe", "decode_1tok_8of256", lambda: bench_moe_decode(bw))
    if args.quick:
        shapes = []
    for name in shapes:
        record("gemv_sweep_M1", name, lambda n=name: bench_gemv_sweep(n, 1, bw))
    if "qkvz_2048_8192" in shapes:
        record("gemv_sweep_M4", "qkvz_2048_8192", lambda: bench_gemv_sweep("qkvz_2048_8192", 4, bw))
    for m in (4, 16, 2, 8):
        for name in shapes:
            record("gemv", f"{name}_M{m}", lambda n=name, m=m: bench_linear(n, m, bw))
    for m in (512, 2048):
        for name in shapes:
            if not (name.startswith("lm_head") and m == 2048):
                record("gemm", f"{name}_M{m}", lambda n=name, m=m: bench_linear(n, m, bw))
    if not args.quick:
        record("fused_moe", "prefill_2048tok_8of256", lambda: bench_moe_prefill(2048))
    RESULTS["meta"]["complete"] = True
    OUT_PATH.write_text(json.dumps(RESULTS, indent=2) + "\n")
    print(f"wrote {OUT_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
