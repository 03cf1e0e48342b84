"""Decode speed of the full-size checkpoint with given fused-MoE tiles (`tinyserve bench`'s
measurement, `engine.bench.run_bench`), e.g. the down kernel as a dependent launch of gate_up
(`MoEFusedConfig.down_pdl`, the default on sm_90+) against ordinary launches.

A mode is "table" (the `MOE_FUSED_TILES` entry), or "block_f,block_b,num_warps,block_h,
down_warps,decode" (a `MoEFusedConfig`), either with ":nopdl" for ordinary launches. Each run
has its own process (one engine each: the decode graphs are captured with the kernels' launch
settings), the modes alternating so that a drift of the machine shows as a spread rather
than as a difference. Reported per run: decode tok/s and the median step.

    python bench/moe_tiles.py CKPT [--modes table table:nopdl] [--kv iso3] [--gpu-memory 6GiB]
        [--runs 2] -> bench/results/moe_tiles[_6GiB].json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import engine_arguments, run_meta  # noqa: E402

KEYS = ("decode_tok_s", "decode_step_ms", "steps", "expert_hit_rate")


def tiles(mode: str, table):
    """The MoEFusedConfig of a mode (see the module docstring) given the table's entry."""
    from tinyserve.kernels.fused_moe_decode import MoEFusedConfig

    spec, _, flag = mode.partition(":")
    if flag not in ("", "nopdl"):
        raise ValueError(f"unknown mode flag {flag!r} in {mode!r}")
    if spec == "table":
        cfg = table
    else:
        *sizes, decode = spec.split(",")
        cfg = MoEFusedConfig(*map(int, sizes), decode)
    return dataclasses.replace(cfg, down_pdl=flag != "nopdl")


def child(args: argparse.Namespace) -> int:
    """One engine with the tiles of mode args.child on every table shape; prints the run as
    JSON."""
    from tinyserve.engine.bench import bench_from_args
    from tinyserve.kernels import fused_moe_decode as fmd

    for shape, cfg in list(fmd.MOE_FUSED_TILES.items()):
        fmd.MOE_FUSED_TILES[shape] = tiles(args.child, cfg)
    r, _ = bench_from_args(args)
    print("RESULT " + json.dumps({k: r[k] for k in KEYS}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    engine_arguments(ap)
    ap.add_argument("--modes", nargs="+", default=["table", "table:nopdl"])
    ap.add_argument("--runs", type=int, default=2, help="runs per mode, alternating")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    tag = f"_{args.gpu_memory}" if args.gpu_memory else ""
    out_path = Path(args.out or ROOT / f"bench/results/moe_tiles{tag}.json")
    passed = [args.model, "--kv", args.kv, "--batch", str(args.batch), "--prompt-len",
              str(args.prompt_len), "--gen-len", str(args.gen_len)]
    if args.gpu_memory:
        passed += ["--gpu-memory", args.gpu_memory]
    runs: dict[str, list[dict]] = {m: [] for m in args.modes}
    for _ in range(args.runs):
        for mode in args.modes:
            proc = subprocess.run([sys.executable, __file__, *passed, "--child", mode],
                                  capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(proc.stdout[-2000:] + proc.stderr[-3000:])
                raise SystemExit(f"the {mode} run failed (exit {proc.returncode})")
            runs[mode].append(json.loads(lines[-1][len("RESULT "):]))
            r = runs[mode][-1]
            print(f"{mode:28s} {r['decode_tok_s']:8.1f} tok/s  step "
                  f"{r['decode_step_ms']:.3f} ms")
    out = run_meta("moe_tiles", model=args.model, kv=args.kv, gpu_memory=args.gpu_memory,
                   batch=args.batch, prompt_len=args.prompt_len, gen_len=args.gen_len,
                   order="modes alternating; one process (engine) per run")
    out["runs"] = runs
    med = {m: statistics.median(r["decode_tok_s"] for r in rs) for m, rs in runs.items()}
    out["median_tok_s"] = med
    first = args.modes[0]
    out["vs_first"] = {m: v / med[first] for m, v in med.items()}
    print("median tok/s: " + ", ".join(f"{m} {v:.1f} ({v / med[first]:.3f})"
                                       for m, v in med.items()))
    out_path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
