"""NVFP4 decode kernels at the 35B-A3B shapes, as the model calls them -> results/nvfp4.json.

One unattended run on one GPU, everything beside its baseline from the same run:
1. bandwidth: a 1 GiB device copy (read + written) and a bf16 cuBLAS GEMV over a 1 GiB
   weight (read only); the larger is the reference `bw` for every fraction below, and the
   fractions of the copy bandwidth alone (the targets' reference) are recorded beside them;
2. GEMV M = 1 on the 35B-A3B shapes (qkvz, lm_head, o_proj, gate_up, down): `nvfp4_linear`
   as the model calls it, against bf16 cuBLAS over a bf16 weight of the same shape;
3. MoE decode, 1 / 4 / 8 tokens x 8 of 256 experts: `fused_moe` as the model calls it,
   routed experts only (1 token) and the whole layer (+ the shared expert: in the CUDA
   decode where `fuses_shared_expert`, else through its own GEMVs), against the time
   to read the experts' bytes at `bw` and at the copy bandwidth (the target: <= 2x of the
   copy-bandwidth read time at 1 token).
Every case is first checked against the torch reference on the GPU (relative Frobenius and
max errors recorded; over 1e-2 it is not timed). Timing: bench/common.py `time_graph`, the
median of 10 replays of a CUDA graph that cycles through enough weight copies (>= 256 MB) to
miss L2. A failing case is recorded and the rest still run.

Usage: python bench/nvfp4.py [--smoke] [--family]  (--smoke: tiny shapes, any device, no
timing; checks the script itself, on a CPU with TRITON_INTERPRET=1 set. --family: only the MoE
decode, at the layer shape of each family member)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import common  # noqa: E402
from tinyserve.kernels.moe import fused as moe  # noqa: E402
from tinyserve.kernels.nvfp4.linear import nvfp4_linear  # noqa: E402
from tinyserve.kernels.nvfp4.ref import dequantize_nvfp4  # noqa: E402
from tinyserve.model.moe import gated_add, swiglu_mlp  # noqa: E402

SHAPES = {  # name: (N, K), most important first
    "qkvz_2048_8192": (8192, 2048), "lm_head_2048_248320": (248320, 2048),
    "o_4096_2048": (2048, 4096), "gate_up_2048_1024": (1024, 2048),
    "down_512_2048": (2048, 512),
}
SMOKE_SHAPES = {"qkvz": (64, 1024), "down": (48, 512)}
# MoE layer shapes of the family (H, F, experts, top-k; specs/qwen35_moe.md 1.2) for --family
FAMILY = {"35B-A3B": (2048, 512, 256, 8), "122B-A10B": (3072, 1024, 256, 8),
          "397B-A17B": (4096, 1024, 512, 10)}
MAX_REL_ERR = 1e-2


def timed(call, calls: list, ref: torch.Tensor, smoke: bool) -> dict:
    """Errors of call() against ref; unless smoke or wrong, the time of `calls` in a graph."""
    res = common.errors(call(), ref)
    if res["rel_err"] > MAX_REL_ERR:
        res["wrong"] = True
    elif not smoke:
        res["us"] = common.time_graph(calls)
    return res


def bench_gemv(n: int, k: int, bw: float, copy_bw: float, dev: str, smoke: bool) -> dict:
    """`nvfp4_linear` at M = 1 on one [N, K] shape against bf16 cuBLAS."""
    wb = common.nvfp4_bytes(n, k)
    ws = [common.rand_nvfp4(n, k, dev) for _ in range(common.copies(wb, smoke))]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    ref = x.float() @ dequantize_nvfp4(ws[0]).to(dev).T
    out: dict = {"N": n, "K": k, "weight_bytes": wb}
    out["nvfp4"] = res = timed(lambda: nvfp4_linear(x, ws[0]),
                               [lambda w=w: nvfp4_linear(x, w) for w in ws], ref, smoke)
    if "us" in res:
        res.update(frac_bw=wb / res["us"] / 1e3 / bw, frac_copy=wb / res["us"] / 1e3 / copy_bw)
    if not smoke:
        dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                 for _ in range(common.copies(2 * n * k))]
        us = common.time_graph([lambda d=d: x @ d.T for d in dense])
        out["bf16_cublas"] = {"us": us, "frac_bw": 2 * n * k / us / 1e3 / bw}
    return out


def expert_slots_fp4(num: int, h: int, f: int, dev: str):
    slots = moe.allocate_expert_slots(num, h, f, fp4=True, device=dev)
    slots.w13.random_(0, 256)
    slots.w2.random_(0, 256)
    slots.w13_scale.random_(0x30, 0x48)
    slots.w2_scale.random_(0x30, 0x48)
    slots.w13_global.fill_(0.5 / h**0.5)
    slots.w2_global.fill_(0.5 / f**0.5)
    return slots


def bench_moe_decode(n: int, bw: float, copy_bw: float, dev: str, smoke: bool,
                     shape: tuple[int, int, int, int] = FAMILY["35B-A3B"]) -> dict:
    """n tokens x top-k of the experts (+ the shared expert, one per "layer") through
    `fused_moe` at `shape` (H, F, experts, top-k), against the time to read the distinct
    experts' bytes."""
    h, f, e, k = (64, 32, 10, 8) if smoke else shape
    slots = expert_slots_fp4(e, h, f, dev)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    x = torch.randn(n, h, device=dev, dtype=dt)
    w = torch.softmax(torch.randn(n, k, device=dev), -1).to(dt)
    reps = 1 if smoke else 20  # routings (and shared experts) per graph: more bytes than L2
    routes = [torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(n)])
              for _ in range(reps)]
    logits = [torch.randn(n, 1, device=dev, dtype=dt) for _ in range(reps)]
    rand = common.rand_nvfp4
    shared_w = [(rand(f, h, dev), rand(f, h, dev), rand(h, f, dev)) for _ in range(reps)]
    shared = [moe.single_expert_slots(*ws) for ws in shared_w]
    expert_bytes = 3 * common.nvfp4_bytes(f, h)
    distinct = statistics.mean(len(torch.unique(r)) for r in routes)
    out: dict = {"H": h, "F": f, "experts": e, "tokens": n, "distinct_experts": distinct,
                 "bytes_per_expert": expert_bytes}

    def routed(i):
        return moe.fused_moe(x, routes[i], w, slots)

    def layer(i):
        if moe.fuses_shared_expert(x, w, shared[i], logits[i]):
            return moe.fused_moe(x, routes[i], w, slots, shared_slots=shared[i],
                                 shared_logit=logits[i])
        # as SparseMoE runs it: the shared expert through its own GEMVs
        return gated_add(routed(i), logits[i], swiglu_mlp(x, *shared_w[i]))

    ref_layer = moe.fused_moe_ref(x, routes[0], w, slots, shared_slots=shared[0],
                                  shared_logit=logits[0]).float()
    cases = {"layer": (layer, ref_layer, distinct + 1)}
    if n == 1:
        cases["routed"] = (routed, moe.fused_moe_ref(x, routes[0], w, slots).float(), distinct)
    for name, (fn, ref, experts) in cases.items():
        read_us = experts * expert_bytes / bw / 1e3
        res = timed(lambda fn=fn: fn(0), [lambda i=i, fn=fn: fn(i) for i in range(reps)],
                    ref, smoke)
        res["read_us"] = read_us
        if "us" in res:
            res.update(ratio_to_read_time=res["us"] / read_us,
                       ratio_to_copy_read_time=res["us"] / (read_us * bw / copy_bw))
        out[name] = res
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (any device)")
    ap.add_argument("--out", default=None, help="default: bench/results/nvfp4.json")
    ap.add_argument("--family", action="store_true",
                    help="only the MoE decode, at every family member's layer shape")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev != "cuda" and not args.smoke:
        print("needs a CUDA GPU (or --smoke)")
        return 1
    out = Path("/tmp/nvfp4_smoke.json" if args.smoke
               else args.out or ROOT / "bench/results/nvfp4.json")
    timing = "median of 10 CUDA-graph replays, weights rotated past L2"
    rec = common.Recorder(out, common.run_meta("nvfp4", timing=timing))
    bw = copy_bw = 4000.0
    if not args.smoke:
        res = rec.run("bandwidth", common.bandwidth, dev) or {}
        bw, copy_bw = res.get("GBps", bw), res.get("copy_GBps", copy_bw)
    if args.family:
        for model, shape in FAMILY.items():
            for n in (1, 4):
                rec.run(f"moe_decode_{n}tok_{model}", bench_moe_decode, n, bw, copy_bw, dev,
                        args.smoke, shape)
    for n in () if args.family else (1, 4, 8):
        rec.run(f"moe_decode_{n}tok_8of256", bench_moe_decode, n, bw, copy_bw, dev, args.smoke)
    for name, (n, k) in {} if args.family else (SMOKE_SHAPES if args.smoke else SHAPES).items():
        rec.run(f"gemv_M1_{name}", bench_gemv, n, k, bw, copy_bw, dev, args.smoke)
    nan = float("nan")
    for name, case in rec.data["cases"].items():
        base = case.get("bf16_cublas", {}).get("us", nan)
        for key in ("nvfp4", "layer", "routed"):
            r = case.get(key)
            if not r:
                continue
            extra = (f"{r.get('ratio_to_copy_read_time', nan):.2f}x the copy read time"
                     if "read_us" in r else
                     f"{r.get('frac_copy', nan):.0%} of the copy bandwidth, bf16 {base:.2f} us")
            print(f"{name:28s} {key:7s} {r.get('us', nan):8.2f} us  {extra}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
