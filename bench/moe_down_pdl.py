"""Decode speed with the fused MoE's down kernel as a dependent launch of its gate_up kernel
(`MoEFusedConfig.down_pdl`, the default on sm_90+) and as an ordinary launch, on the full-size
checkpoint (`tinyserve bench`'s measurement, `engine.bench.run_bench`).

Each mode runs in its own process (one engine each: the decode graphs are captured with the
kernels' launch settings), alternating on / off so that a drift of the machine shows as a
spread rather than as a difference. Reported per run: decode tok/s and the median step.

    python bench/moe_down_pdl.py CKPT [--kv iso3] [--gpu-memory 6GiB] [--runs 2]
        -> bench/results/moe_down_pdl[_6GiB].json
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

from bench.common import run_meta  # noqa: E402

KEYS = ("decode_tok_s", "decode_step_ms", "steps", "expert_hit_rate")


def child(args: argparse.Namespace) -> int:
    """One engine with down_pdl = args.child ("on" / "off"); prints the run as JSON."""
    from tinyserve.engine.bench import run_bench
    from tinyserve.engine.build import build_engine
    from tinyserve.engine.config import EngineConfig
    from tinyserve.kernels import fused_moe_decode as fmd

    for shape, cfg in list(fmd.MOE_FUSED_TILES.items()):
        fmd.MOE_FUSED_TILES[shape] = dataclasses.replace(cfg, down_pdl=args.child == "on")
    config = EngineConfig.from_args(args, max_seqs=args.batch,
                                    max_context=args.prompt_len + args.gen_len)
    engine = build_engine(config).start()
    try:
        r = run_bench(engine, prompt_len=args.prompt_len, gen_len=args.gen_len,
                      batch=args.batch)
    finally:
        engine.shutdown()
    print("RESULT " + json.dumps({k: r[k] for k in KEYS}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--kv", default="iso3")
    ap.add_argument("--gpu-memory", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2, help="runs per mode, alternating")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", choices=("on", "off"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    tag = f"_{args.gpu_memory}" if args.gpu_memory else ""
    out_path = Path(args.out or ROOT / f"bench/results/moe_down_pdl{tag}.json")
    passed = [a for a in sys.argv[1:] if a not in ("--out", args.out)]
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for _ in range(args.runs):
        for mode in ("on", "off"):
            proc = subprocess.run([sys.executable, __file__, *passed, "--child", mode],
                                  capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(proc.stdout[-2000:] + proc.stderr[-3000:])
                raise SystemExit(f"the {mode} run failed (exit {proc.returncode})")
            runs[mode].append(json.loads(lines[-1][len("RESULT "):]))
            r = runs[mode][-1]
            print(f"down_pdl {mode:3s} {r['decode_tok_s']:8.1f} tok/s  step "
                  f"{r['decode_step_ms']:.3f} ms")
    out = run_meta("moe_down_pdl", model=args.model, kv=args.kv, gpu_memory=args.gpu_memory,
                   batch=args.batch, prompt_len=args.prompt_len, gen_len=args.gen_len,
                   order="on, off alternating; one process (engine) per run")
    out["runs"] = runs
    med = {m: statistics.median(r["decode_tok_s"] for r in rs) for m, rs in runs.items()}
    out["median_tok_s"] = med
    out["on_vs_off"] = med["on"] / med["off"]
    print(f"median: on {med['on']:.1f}, off {med['off']:.1f} tok/s ({out['on_vs_off']:.3f})")
    out_path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
